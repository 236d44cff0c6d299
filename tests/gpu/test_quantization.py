"""Linear methods (``--quantization``): each one against plain math on the same weights,
end to end through the runner, and the registry a plugin extends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from actorlm.config import EngineConfig, ModelConfig
from actorlm.extensions.points import QUANTIZATION_METHODS
from actorlm.extensions.registry import UnknownNameError
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.platforms import CpuPlatform
from actorlm.gpu.quantization import (
    Fp16Linear,
    LinearMethod,
    fbgemm_available,
)
from torch import nn

from .helpers import Pages, assert_matches_hf, hf_model, make_runner

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm (x86 PyTorch)")

PROMPTS = [list(range(100, 141)), [5, 17, 923, 4, 4, 88, 1200, 31, 7], [42]]


def _fp16_rounded_reference(path: Path) -> Any:
    """transformers' model with every linear weight (and the LM head, untied from the
    embeddings) rounded to fp16: the exact weights the fp16 method computes with."""
    model = hf_model(path)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not model.lm_head:
                module.weight.copy_(module.weight.half().float())
        head = model.lm_head.weight.detach().half().float().clone()
        model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    return model


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", True)])
def test_fp16_method_matches_transformers_on_fp16_rounded_weights(
    arch: str, tied: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    path = tiny_model_factory(arch, tie_word_embeddings=tied)
    runner = make_runner(path, quantization="fp16")
    linears = [m for m in runner.model.modules() if isinstance(m, nn.Linear | Fp16Linear)]
    assert all(isinstance(m, Fp16Linear) for m in linears)
    # qkv, o, gate_up and down per layer, and the LM head (tied: the embedding's copy)
    assert len(linears) == 4 * runner.info.num_layers + 1
    assert isinstance(runner.model.head if tied else runner.model.lm_head, Fp16Linear)
    ref = _fp16_rounded_reference(path)
    assert_matches_hf(runner, ref, PROMPTS)


def test_fp16_layer_is_plain_math_on_fp16_rounded_weights() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(300, 96), torch.randn(300)
    x = torch.randn(7, 96)
    got = Fp16Linear(w, b)(x)
    assert (got - F.linear(x, w.half().float(), b)).abs().max().item() < 1e-4
    assert (got - F.linear(x, w, b)).abs().max().item() > 0  # it did round


def test_fp16_wide_layer_is_sharded_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Fp16Linear, "SHARD_ROWS", 64)
    torch.manual_seed(0)
    w, b = torch.randn(300, 48), torch.randn(300)  # shards of 64 rows, the last one 44
    x = torch.randn(5, 48)
    layer = Fp16Linear(w, b)
    assert len(layer.shards) == 5
    assert (layer(x) - F.linear(x, w.half().float(), b)).abs().max().item() < 1e-4


def test_registry_checks_and_platform_default(tiny_llama: Path) -> None:
    assert {"none", "fp16", "gguf"} <= set(QUANTIZATION_METHODS.names())
    with pytest.raises(UnknownNameError, match="known: .*fp16"):
        make_runner(tiny_llama, quantization="nf4")
    with pytest.raises(ValueError, match="float32"):
        make_runner(tiny_llama, quantization="fp16", dtype="bfloat16")
    unset = CpuPlatform().adjust_defaults(EngineConfig())
    int8 = CpuPlatform.int8_rows_fastest()  # VNNI without native bf16: int8 rows
    assert unset.model.quantization == ("gguf_a8" if int8 else "gguf")
    bf16 = EngineConfig(model=ModelConfig(dtype="bfloat16"))
    assert CpuPlatform().adjust_defaults(bf16).model.quantization == "gguf"  # bf16 GEMMs


class _Scaled(nn.Module):
    """A plugin's layer: plain math on the weight, counting its calls."""

    calls = 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Scaled.calls += 1
        return F.linear(x, self.weight, self.bias)


class _CountingMethod(LinearMethod):
    name = "counting"

    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return _Scaled(weight, bias)


def test_a_registered_method_computes_every_linear(tiny_llama: Path) -> None:
    QUANTIZATION_METHODS.register("counting", _CountingMethod)
    try:
        runner = make_runner(tiny_llama, quantization="counting")
        plain = make_runner(tiny_llama, quantization="none")
    finally:
        QUANTIZATION_METHODS.unregister("counting")
    pages = Pages()
    seqs = [SeqSpec(PROMPTS[0], 0, pages.table("a", len(PROMPTS[0])))]
    _Scaled.calls = 0
    ours = runner.run(seqs)
    layers = runner.info.num_layers
    assert _Scaled.calls == 4 * layers + 1  # qkv, o, gate_up, down per layer; the LM head
    assert (ours - plain.run(seqs)).abs().max().item() < 1e-5
