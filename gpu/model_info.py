"""What a model is, read cheaply (config.json or GGUF metadata, never the weights).

``ModelInfo`` carries both what the launcher needs to size the KV pool before any
actor starts and the hyperparameters the model is built from, so every weight
loader produces the same normalized description whatever the file format.
Family defaults that a config may leave out (Gemma's layer pattern, Qwen's
windowed layers) are filled here, once, as transformers' config classes do.
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

# Qwen's MoE configs default to unnormalized top-k weights; Mixtral always renormalizes.
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")
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
    model_type: str = ""  # config.json model_type (qwen3, gemma2, ...)
    eos_token_ids: list[int] = []
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini: 0.75)
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    # What this checkpoint has that the built-in native models do not build (--model-impl
    # auto then runs the transformers fallback; native refuses it, saying which)
    native_gaps: list[str] = []
    sliding_window: int | None = None  # the window of the windowed layers
    layer_windows: list[int] = []  # per layer, 0 = full attention; [] = every layer full
    # Gemma 3: the windowed layers' own RoPE (None: the same as the full layers')
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale 1/sqrt(this)
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen-MoE)
    mlp_only_layers: list[int] = []  # dense layers among the sparse ones
    shared_expert_intermediate_size: int = 0
    num_pages: int = 0  # filled in by the runner once the KV pool exists
    page_size: int = 0
    dtype: str = ""
    source_format: str = ""  # safetensors | gguf

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window in tokens (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` has a mixture-of-experts MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(1, self.decoder_sparse_step) == 0
        )


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
        from .gguf_info import gguf_model_info

        return gguf_model_info(path)
    if (path / "config.json").exists():
        return hf_model_info(path)
    raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` the config sets (families name the same thing differently:
    GPT-2's ``n_layer`` is Llama's ``num_hidden_layers``)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is None:
        raise KeyError(f"config.json sets none of {', '.join(keys)}")
    return default


def _rope(cfg: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) for layers of ``layer_type``. transformers 5 writes
    ``rope_parameters`` (per layer type for Gemma 3); 4.x wrote rope_theta + rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    elif "full_attention" in params:  # per-type parameters, this type absent: the full one
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind in ("su", "yarn") and cfg.get("model_type") == "phi3":
        kind = "longrope"  # Phi-3's configs call LongRoPE by its old names
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    if "original_max_position_embeddings" in cfg:
        scaling.setdefault(
            "original_max_position_embeddings", cfg["original_max_position_embeddings"]
        )
    return theta, scaling


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, list[int]]:
    """(window, per-layer windows) from ``layer_types``, or the family's default pattern."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2/3 carry a window they do not use
        window = None
    if not window:
        return None, []
    window = int(window)
    types = cfg.get("layer_types")
    if types is None:
        model_type = cfg.get("model_type", "")
        if model_type == "gemma2":
            pattern = 2
        elif model_type in ("gemma3", "gemma3_text"):
            pattern = int(cfg.get("sliding_window_pattern", 6))
        else:
            pattern = 0  # every layer windowed (Mistral, Phi-3), Qwen's from max_window_layers
        first = int(cfg.get("max_window_layers", 0)) if "max_window_layers" in cfg else 0
        types = [
            "sliding_attention"
            if (pattern and (i + 1) % pattern) or (not pattern and i >= first)
            else "full_attention"
            for i in range(num_layers)
        ]
    windows = [window if t == "sliding_attention" else 0 for t in types]
    return window, windows if any(windows) else []


def hf_model_info(folder: Path) -> ModelInfo:
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if isinstance(cfg.get("text_config"), dict):  # a multimodal wrapper: its language model
        cfg = {**cfg, **cfg["text_config"], "architectures": archs}
    heads = int(_first(cfg, "num_attention_heads", "n_head", "num_heads"))
    hidden = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
    layers = int(_first(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    eos = _as_list(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.exists():  # generation_config often lists more stop ids (Llama 3's <|eot_id|>)
        gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
        eos = list(dict.fromkeys(eos + gen_eos))
    max_pos = int(_first(cfg, "max_position_embeddings", "n_positions", default=2048))
    theta, scaling = _rope(cfg, "full_attention")
    window, windows = _layer_windows(cfg, layers)
    sliding_theta, sliding_scaling = (None, None)
    if isinstance((cfg.get("rope_parameters") or {}).get("sliding_attention"), dict):
        sliding_theta, sliding_scaling = _rope(cfg, "sliding_attention")
    rope_params = cfg.get("rope_parameters") or {}
    partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    gaps = []
    if cfg.get("attention_bias") and archs[0] != "Qwen2ForCausalLM":  # Qwen2's is q/k/v only
        gaps.append("a bias on o_proj (attention_bias)")
    if cfg.get("mlp_bias"):
        gaps.append("biases on the MLP (mlp_bias)")
    return ModelInfo(
        architecture=archs[0],
        model_type=str(cfg.get("model_type", "")),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=0)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_model_len=max_pos,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(
            cfg.get("attention_bias", cfg.get("qkv_bias", archs[0] == "Qwen2ForCausalLM"))
        ),
        native_gaps=gaps,
        sliding_window=window,
        layer_windows=windows,
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(
            cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0
        )
        if experts
        else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") not in _QWEN_MOE)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        source_format="safetensors",
    )
