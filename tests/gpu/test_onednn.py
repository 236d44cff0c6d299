"""bf16 linears packed once for oneDNN (``gpu/onednn.py``): the same products as
``F.linear``, and packed only where nothing reads the plain weight."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu import onednn
from actorlm.gpu.models.layers import MergedLinear
from actorlm.gpu.onednn import OneDNNLinear, pack_linears, packable
from actorlm.gpu.quantization import GGUFLinear
from torch import nn

from .helpers import make_runner
from .kernels.test_qgemm import _block_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not onednn.available(CPU, torch.bfloat16),
    reason="packed bf16 GEMMs need a CPU with AMX or AVX512-BF16 and PyTorch with oneDNN",
)


def test_only_bf16_on_the_cpu() -> None:
    assert not onednn.available(CPU, torch.float32)
    assert not onednn.available(torch.device("meta"), torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_products_match_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(192, 136, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(136, 192, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(136, generator=g))
    x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    layer = OneDNNLinear(lin)
    assert layer.packed.is_mkldnn and not hasattr(layer, "weight")  # no plain copy kept
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 136)
    # fp32 accumulation either way; the output rounds to bf16 (8 bits of mantissa)
    tol = want.abs().max().item() * 2**-7
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    torch.testing.assert_close(
        got.float(), F.linear(x, lin.weight, lin.bias).float(), atol=tol, rtol=0
    )
    # a strided view of rows is taken too
    wide = torch.randn(rows, 2 * 192, generator=g).to(torch.bfloat16)[:, :192]
    torch.testing.assert_close(
        OneDNNLinear(lin)(wide).float(),
        F.linear(wide, lin.weight, lin.bias).float(),
        atol=tol,
        rtol=0,
    )


class _ReadsItsWeights(nn.Module):
    plain_linears = True  # its code reads proj.weight itself

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 16, bias=False).to(torch.bfloat16)


def test_what_is_packed() -> None:
    merged = MergedLinear(64, [("q", 32), ("k", 16)], bias=False).to(torch.bfloat16)
    stacked = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    view = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    view.weight = nn.Parameter(stacked[1], requires_grad=False)  # an expert of a stack
    model = nn.ModuleDict(
        {
            "merged": merged,
            "fp32": nn.Linear(64, 8),
            "view": view,
            "kept": nn.Linear(64, 8).to(torch.bfloat16),
            "reads": _ReadsItsWeights(),
        }
    )
    kept = model["kept"].weight.data_ptr()
    assert pack_linears(model, {kept}) == 1
    assert isinstance(model["merged"], OneDNNLinear)
    assert model["merged"].shards == {"q": (0, 32), "k": (32, 16)}  # LoRA's row map
    assert type(model["fp32"]) is nn.Linear and type(model["kept"]) is nn.Linear
    assert type(model["reads"].proj) is nn.Linear  # under plain_linears
    assert not packable(model["view"])


def test_runner_leaves_the_fused_steps_weights_plain(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    fused = make_runner(tiny_model_factory("llama"), dtype="bfloat16")
    assert fused.fused is not None
    assert not any(isinstance(m, OneDNNLinear) for m in fused.model.modules())
    plain = make_runner(tiny_model_factory("llama"), dtype="bfloat16", fused_decode_max_batch=0)
    layers = plain.model.model.layers
    assert not any(isinstance(m, nn.Linear) for m in layers.modules())
    assert sum(isinstance(m, OneDNNLinear) for m in layers.modules()) == 4 * len(layers)
    # GGUF blocks: the fused step reads the blocks; the dense copy for long prompts packs
    blocks = make_runner(
        _block_model(tiny_model_factory("llama"), tmp_path / "blocks"),
        dtype="bfloat16",
        quantization="gguf",
    )
    assert blocks.fused is not None
    gguf = [m for m in blocks.model.modules() if isinstance(m, GGUFLinear)]
    assert gguf and all(isinstance(m.dense, OneDNNLinear) for m in gguf)


def test_adapters_on_top_of_packed_linears(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    from actorlm.gpu.lora.layers import LoRALayer

    from .helpers import hf_last_logits
    from .lora.test_lora_layers import PROMPTS, lora_runner, mixed_prefill, peft_model

    runner = lora_runner(tiny_llama, lora_adapters, dtype="bfloat16", fused_decode_max_batch=0)
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALayer)]
    assert wrapped and all(isinstance(m.base, OneDNNLinear) for m in wrapped)
    names = ["sql", "", "all"]
    logits = mixed_prefill(runner, names)
    for row, name in enumerate(names):
        ref = hf_last_logits(peft_model(tiny_llama, lora_adapters.get(name)), PROMPTS[name])
        scale = ref.abs().max().item()
        assert (logits[row] - ref).abs().max().item() < 0.03 * scale, name  # bf16 (test_bf16)
    base = hf_last_logits(peft_model(tiny_llama, None), PROMPTS["sql"])
    assert (logits[0] - base).abs().max().item() > 0.1  # the adapter does change the output
