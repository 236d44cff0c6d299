"""What a model is, read cheaply (config.json or GGUF metadata, never the weights).

``ModelInfo`` carries both what the launcher needs to size the KV pool before any
actor starts and the hyperparameters the model is built from, so every weight
loader produces the same normalized description whatever the file format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "ModelInfo",
    "dtype_size",
    "kv_bytes_per_token",
    "kv_pages_for_budget",
    "load_model_info",
]

# llama.cpp architecture names → the HF class our model registry is keyed by.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str  # HF class name, the MODELS registry key
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = []
    bos_token_id: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    sliding_window: int | None = None
    num_pages: int = 0  # filled in by the runner once the KV pool exists
    page_size: int = 0
    dtype: str = ""
    source_format: str = ""  # safetensors | gguf


def dtype_size(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def kv_bytes_per_token(info: ModelInfo, dtype: str) -> int:
    """K and V of one token across all layers."""
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * dtype_size(dtype)


def kv_pages_for_budget(info: ModelInfo, budget_bytes: float, page_size: int, dtype: str) -> int:
    """How many KV pages of ``page_size`` tokens fit in ``budget_bytes``."""
    pages = int(budget_bytes // (kv_bytes_per_token(info, dtype) * page_size))
    if pages < 1:
        raise ValueError(
            f"KV budget of {budget_bytes / 2**20:.1f} MiB holds no page of {page_size} tokens"
        )
    return pages


def load_model_info(path: str | Path) -> ModelInfo:
    """Read ``path`` (an HF folder or a ``.gguf`` file) without touching its weights."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_info(path)
    if (path / "config.json").exists():
        return hf_model_info(path)
    raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def hf_model_info(folder: Path) -> ModelInfo:
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    eos = _as_list(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.exists():  # generation_config often lists more stop ids (Llama 3's <|eot_id|>)
        gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
        eos = list(dict.fromkeys(eos + gen_eos))
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{folder}: hidden_act {cfg['hidden_act']!r} unsupported (Llama family uses silu)"
        )
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2 carries a window it does not use
        window = None
    return ModelInfo(
        architecture=archs[0],
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_model_len=max_pos,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
        sliding_window=int(window) if window else None,
        source_format="safetensors",
    )


def gguf_model_info(path: Path, gguf_file: Any = None) -> ModelInfo:
    from .gguf_file import GGUFFile

    f = gguf_file or GGUFFile(path)
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} unsupported; known: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(f.get("tokenizer.ggml.tokens"))
    tied = "output.weight" not in f.tensors
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(meta("rope.scaling.factor", 1.0)),
        }
    ctx = int(meta("context_length", 2048))
    bos = f.get("tokenizer.ggml.bos_token_id")
    return ModelInfo(
        architecture=GGUF_ARCHITECTURES[arch],
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        vocab_size=int(vocab),
        max_model_len=ctx,
        eos_token_ids=_as_list(f.get("tokenizer.ggml.eos_token_id")),
        bos_token_id=None if bos is None else int(bos),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=ctx,
        tie_word_embeddings=tied,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        source_format="gguf",
    )
