"""llama.cpp GGUF files: hyperparameters from the metadata (``gguf_info``), tensors
dequantized (F32/F16/Q4_0/Q4_1/Q8_0/K-quants, via ``gguf.quants``) one at a time
and renamed to HF names, undoing what llama.cpp's converter changed:

- Llama/Mistral/Mixtral q/k rows interleaved for llama.cpp's RoPE kernel (restored
  to HF's two halves);
- Gemma's norms stored as ``1 + weight`` (the 1 taken back off);
- experts stacked into one [experts, out, in] tensor per projection (split back
  into HF's ``experts.{e}.{gate,up,down}_proj``);
- Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and up) kept fused, as HF has them.

(The tokenizer and chat template in the file are the tokenizer actor's job.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..gguf_file import GGUFFile
from ..gguf_info import gguf_model_info
from ..model_info import ModelInfo
from .base import WeightLoader

__all__ = ["GGUFLoader", "gguf_tensor_name"]

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms a layer: ffn_norm is the one before the MLP there
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_tensor_name(name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; None if unused
    (``rope_freqs``, Phi-3's ``rope_factors_*``: read as metadata). Experts keep a ``{}``
    for their index."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    table = {**_LAYER_NAMES, **_GEMMA_NAMES} if arch.startswith("gemma") else _LAYER_NAMES
    if arch == "phi3" and parts[2] == "ffn_up":
        return f"model.layers.{parts[1]}.mlp.gate_up_proj.{parts[3]}"  # gate and up, fused
    hf = table.get(parts[2])
    return None if hf is None else f"model.layers.{parts[1]}.{hf}.{parts[3]}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, rows go from interleaved
    pairs (r0, r1 of each rotary pair adjacent) back to HF's two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(w: np.ndarray) -> torch.Tensor:
    # dequantize may return a read-only view of the mapped file (F32 tensors)
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=not w.flags.writeable))


class GGUFLoader(WeightLoader):
    name = "gguf"

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(path)
        self.file = GGUFFile(self.path)
        self._info: ModelInfo | None = None

    def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = gguf_model_info(self.path, self.file)
        return self._info

    def num_weights(self) -> int:
        return len(self.file.tensors)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        info = self.model_info()
        arch = self.file.get("general.architecture")
        permuted = arch in ("llama", "mistral")
        for gguf_name in self.file.tensors:
            name = gguf_tensor_name(gguf_name, arch)
            if name is None:
                continue
            w = self.file.dequantize(gguf_name)  # float32 [out, in] ([experts, out, in])
            if permuted and name.endswith("q_proj.weight"):
                w = unpermute_rope_rows(w, info.num_heads)
            elif permuted and name.endswith("k_proj.weight"):
                w = unpermute_rope_rows(w, info.num_kv_heads)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):
                w = w - 1.0
            if "{}" in name:
                for e in range(w.shape[0]):
                    yield name.format(e), _tensor(w[e])
            else:
                yield name, _tensor(w)
