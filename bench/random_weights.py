"""A model folder with no weights: a config at a chosen shape, a word-level tokenizer over
its whole vocabulary, and the ``random`` weight loader that fills every parameter on
the device (normal, std 0.02; norms 1). For benchmarks at a real model's shape where no
checkpoint can be downloaded (bench/gpu.py).

The loader is registered in this process only, so the engine must run its actors here
(``Engine(placement="inproc")``) or use a ``ModelRunner`` directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from actorlm.extensions.points import WEIGHT_LOADERS
from actorlm.gpu.loaders.base import WeightLoader
from actorlm.gpu.model_info import ModelInfo, hf_model_info
from torch import nn

__all__ = ["LLAMA3_8B", "SMOKE", "RandomLoader", "register", "write_model"]

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}
# The same architecture, small enough for any machine: checks the script, not the device.
SMOKE: dict[str, Any] = {
    **LLAMA3_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}


def write_model(folder: Path, config: dict[str, Any]) -> Path:
    """config.json and a tokenizer whose token ``i`` is the word ``t{i}`` (0, 1, 2: the
    unknown, bos and eos tokens, spelled apart: a special token is matched anywhere in
    a text, so ``t1`` would cut ``t17`` in two)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update((f"t{i}", i) for i in range(len(specials), config["vocab_size"]))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(folder))
    return folder


class RandomLoader(WeightLoader):
    name = "random"

    def model_info(self) -> ModelInfo:
        return hf_model_info(self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def load(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        for name, param in list(model.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            data = torch.empty(param.shape, dtype=dtype, device=device)
            if "norm" in name:
                data.fill_(1.0)
            else:
                data.normal_(0.0, 0.02, generator=gen)
            setattr(model.get_submodule(owner), leaf, nn.Parameter(data, requires_grad=False))


def register() -> None:
    if "random" not in WEIGHT_LOADERS:
        WEIGHT_LOADERS.register("random", RandomLoader, help="random weights (benchmarks)")
