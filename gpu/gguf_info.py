"""GGUF metadata → ``ModelInfo``, for the architectures llama.cpp and actorlm both define.

llama.cpp's converter leaves some of a family's hyperparameters out of the file
and hard-codes them in its runtime instead; they are restored here the same way
(Gemma's layer patterns and query scale, Gemma 3's local RoPE base, Qwen3-MoE's
renormalized routing), so a GGUF and the HF folder it came from describe the
same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .model_info import ModelInfo

__all__ = ["GGUF_ARCHITECTURES", "gguf_model_info"]

# llama.cpp architecture names → the HF class our model registry is keyed by
# (a "llama" file with experts is a Mixtral).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# llama.cpp's layer patterns (every n-th layer global) and its 27B query-scale rule:
# the 27B models scale by hidden/heads, the others by the head size.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_scaling(f: Any, arch: str, meta: Any, head_dim: int) -> dict[str, Any] | None:
    if "rope_factors_long.weight" in f.tensors:  # Phi-3's LongRoPE: the factors are tensors
        return {
            "rope_type": "longrope",
            "long_factor": f.dequantize("rope_factors_long.weight").ravel().tolist(),
            "short_factor": f.dequantize("rope_factors_short.weight").ravel().tolist(),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "attention_factor": float(meta("rope.scaling.attn_factor", 1.0)),
        }
    kind = meta("rope.scaling.type")
    if not kind or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta("rope.scaling.factor", 1.0))}
    if (orig := meta("rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


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
    layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    # the embedding's rows (llama.cpp may trim a padded vocabulary to the tokenizer's)
    vocab = f.tensors["token_embd.weight"].shape[0]
    ctx = int(meta("context_length", 2048))
    bos = f.get("tokenizer.ggml.bos_token_id")
    experts = int(meta("expert_count", 0))
    architecture = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and experts:
        architecture = "MixtralForCausalLM"
    window = int(meta("attention.sliding_window", 0) or 0)
    windows: list[int] = []
    if window:
        pattern = int(meta("attention.sliding_window_pattern", _SWA_PATTERN.get(arch, 0)))
        windows = [window if not pattern or (i + 1) % pattern else 0 for i in range(layers)]
    scalar = None
    if arch in _LAYERS_27B:
        scalar = float(hidden // heads if layers == _LAYERS_27B[arch] else head_dim)
    rope_dims = int(meta("rope.dimension_count", head_dim))
    eos = _as_list(f.get("tokenizer.ggml.eos_token_id"))
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        eos += [i for i in _as_list(f.get(key)) if i not in eos]
    return ModelInfo(
        architecture=architecture,
        model_type=_MODEL_TYPES.get(arch, arch if not experts else "mixtral"),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length", 0)),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        max_model_len=ctx,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        hidden_act="gelu_pytorch_tanh" if arch.startswith("gemma") else "silu",
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 1e6 if arch == "gemma3" else 1e4)),
        rope_scaling=_rope_scaling(f, arch, meta, head_dim),
        partial_rotary_factor=rope_dims / head_dim,
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        sliding_window=window or None,
        layer_windows=windows if any(windows) else [],
        sliding_rope_theta=float(meta("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=meta("attn_logit_softcapping"),
        final_logit_softcapping=meta("final_logit_softcapping"),
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count", 0)),
        moe_intermediate_size=int(
            meta("expert_feed_forward_length", meta("feed_forward_length", 0))
        )
        if experts
        else 0,
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        source_format="gguf",
    )
