"""llama.cpp GGUF files: hyperparameters from the metadata, tensors dequantized
(F32/F16/Q4_0/Q4_1/Q8_0/K-quants, via ``gguf.quants``) one at a time and renamed
to HF names. llama.cpp's converter interleaves the rows of q/k for its RoPE
kernel on Llama models; ``weights`` undoes that so the model sees HF layout.
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
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_tensor_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; None if unused."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None  # e.g. rope_freqs.weight


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, rows go from interleaved
    pairs (r0, r1 of each rotary pair adjacent) back to HF's two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
        permuted = self.file.get("general.architecture") in ("llama", "mistral")
        for gguf_name in self.file.tensors:
            name = gguf_tensor_name(gguf_name)
            if name is None:
                continue
            w = self.file.dequantize(gguf_name)  # float32 [out, in]
            if permuted and name.endswith("q_proj.weight"):
                w = unpermute_rope_rows(w, info.num_heads)
            elif permuted and name.endswith("k_proj.weight"):
                w = unpermute_rope_rows(w, info.num_kv_heads)
            # dequantize may return a read-only view of the mapped file (F32 tensors)
            yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=not w.flags.writeable))
