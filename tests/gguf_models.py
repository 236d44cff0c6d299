"""GGUF files of the tiny family models, written the way llama.cpp's converter
(``convert_hf_to_gguf.py``) writes each architecture, so the GGUF loader is tested
on what real files hold: its metadata keys, its tensor names (``gguf``'s own
mapping), Gemma's norms stored as ``1 + weight``, Llama's q/k rows interleaved for
its RoPE kernel, experts stacked into one [experts, out, in] tensor per projection,
Phi-3's fused projections and LongRoPE factors as tensors. The tokenizer (a GPT-2
BPE vocabulary padded to the embedding's rows, its merges), chat template and stop
tokens come from the HF folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_gguf"]

_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|im_end|>")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the rows of each rotary pair adjacent."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _metadata(w: Any, arch: str, cfg: dict[str, Any], vocab: int) -> None:
    import gguf

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        rope = rope["full_attention"]
    if arch != "gemma2":  # llama.cpp writes no base for Gemma 2 (its runtime's 10k)
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "phi3":
        partial = rope.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // heads)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))


def _tokenizer(w: Any, folder: Path, vocab: int) -> None:
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = [""] * vocab
    types = [gguf.TokenType.UNUSED] * vocab
    for text, i in data["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    for i in range(vocab):
        tokens[i] = tokens[i] or f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    if eot := next((t for t in _END_OF_TURN if t in ids and t != tok_cfg["eos_token"]), None):
        w.add_eot_token_id(ids[eot])
    template = folder / "chat_template.jinja"
    w.add_chat_template(template.read_text() if template.exists() else tok_cfg["chat_template"])


def write_gguf(folder: Path, out: Path, expert_type: str = "F32") -> Path:
    """The HF model at ``folder`` as llama.cpp's converter would write it; expert
    tensors in ``expert_type`` (F32 or Q8_0), every other tensor F32."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = _ARCH[cfg["architectures"][0]]
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg["num_hidden_layers"])
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, arch, cfg, vocab)
    _tokenizer(w, folder, vocab)
    heads, kv_heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, t in tensors.items():
        t = t.astype(np.float32)
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's 1 + weight
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv_heads)
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.<mlp>.experts.E.<proj>.weight → stacked
            e = parts.index("experts")
            stacked = ".".join(parts[: e + 1] + parts[e + 2 :])
            experts.setdefault(stacked, []).append((int(parts[e + 1]), t))
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, t)
    for name, items in experts.items():
        t = np.stack([x for _, x in sorted(items, key=lambda p: p[0])])
        gguf_name = name_map.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, name
        if expert_type == "Q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name, quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, t)
    if arch == "phi3" and (rope := cfg.get("rope_parameters") or {}).get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor(
            "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
