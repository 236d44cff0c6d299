"""``--quantization q8_0`` / ``q4_1``: any checkpoint rounded to GGUF blocks as it loads.

The rounding is checked bit for bit against ``gguf.quants`` (llama.cpp's reference
quantizer, ported); the kernels on the rounded blocks against plain math; and whole
models through the runner against transformers on the same rounded weights: exact in
float32, in bfloat16 no farther from them than transformers' own bf16 model is, fused
decode steps and the model's own layers alike.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.kernels import qgemm
from actorlm.gpu.models.layers import GatedMLP
from actorlm.gpu.quantization import GGUFLinear, Q8_0Method
from torch import nn

from .helpers import assert_matches_hf, hf_model, make_runner
from .test_bf16 import PROMPT, STEPS, forced_logits, hf_greedy_logits

KINDS = ["q8_0", "q4_1"]


def _weight() -> torch.Tensor:
    """Random rows with the blocks a quantizer must get right: all zero, one tiny value,
    all equal, a wide range."""
    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.05
    w[3, :32] = 0.0
    w[5, 32:64] = 0.0
    w[5, 40] = 1e-3
    w[7, 64:] = 0.25
    w[9, :32] = torch.linspace(-3.0, 5.0, 32)
    return w


# the C rounding (cpu_pack.c) where it builds, and torch's ops
PATHS = [
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(qgemm._pack_lib() is None, reason="no C compiler here"),
    ),
    pytest.param(False, id="torch"),
]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_rounding_is_llama_cpp_s_bit_for_bit(
    kind: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    monkeypatch.setattr(qgemm, "_QUANTIZE_ROWS", 16)  # rows in slices, the last one short
    w = _weight()
    values = torch.empty(40, 96)
    packed = qgemm.quantize(w, kind, values, native=native)
    assert packed is not None and packed.kind == kind and packed.shape == (40, 96)
    # what dequantize gives, bit for bit (signs of zero too)
    assert torch.equal(values.view(torch.int32), packed.dequantize().view(torch.int32))
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    try:
        want = dequantize(quantize(w.numpy(), qtype), qtype).reshape(w.shape)
    except NotImplementedError:  # gguf releases before its numpy quantizers
        pytest.skip(f"this gguf package cannot quantize {kind}")
    got = packed.dequantize().numpy()
    assert np.array_equal(got, want)
    # and it did round: half a step, and what rounding the scales to fp16 moves (codes
    # of up to 127 times a 2^-11 relative error, or a subnormal's 2^-25; Q4_1's minimum)
    d, _ = packed.scales()
    blocks = w.view(40, 3, 32)
    err = (packed.dequantize().view(40, 3, 32) - blocks).abs().amax(-1)
    bound = 0.57 * d + 2**-11 * blocks.abs().amax(-1) + 127 * 2**-25
    assert (err <= bound).all()
    assert err.max() > 0


@pytest.mark.parametrize("native", PATHS)
def test_what_cannot_be_blocks_is_refused(native: bool) -> None:
    assert qgemm.quantize(torch.randn(8, 48), "q8_0", native=native) is None  # K not whole blocks
    for bad in (float("inf"), float("-inf"), float("nan")):
        w = torch.randn(8, 64)
        w[2, 5] = bad
        assert qgemm.quantize(w, "q4_1", native=native) is None
        assert qgemm.quantize(w, "q8_0", native=native) is None
    big = torch.full((4, 32), 1e9)  # Q8_0's scale and Q4_1's minimum overflow fp16
    assert qgemm.quantize(big, "q8_0", native=native) is None
    assert qgemm.quantize(big, "q4_1", native=native) is None
    wide = torch.randn(4, 32)
    wide[1, :2] = torch.tensor([3e38, -3e38])  # finite, but max - min overflows fp32
    assert qgemm.quantize(wide, "q4_1", native=native) is None
    assert qgemm.quantize(wide, "q8_0", native=native) is None
    with pytest.raises(ValueError, match="known: q8_0, q4_1"):
        qgemm.quantize(torch.randn(4, 32), "q5_0", native=native)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_values_in_bf16_are_the_fp32_values_converted(kind: str, native: bool) -> None:
    """A bf16 model's dense copy written straight in bf16: what ``.to(torch.bfloat16)``
    of the fp32 values gives, bit for bit (nearest even), and the same blocks."""
    w = _weight() * 7
    fp32, bf16 = torch.empty(40, 96), torch.empty(40, 96, dtype=torch.bfloat16)
    a = qgemm.quantize(w, kind, fp32, native=native)
    b = qgemm.quantize(w, kind, bf16, native=native)
    assert a is not None and b is not None and torch.equal(a.q, b.q)
    assert torch.equal(bf16.view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="contiguous fp32 or bf16"):
        qgemm.quantize(w, kind, torch.empty(40, 96, dtype=torch.float16), native=native)
    with pytest.raises(ValueError, match="contiguous fp32 or bf16"):
        qgemm.quantize(w, kind, torch.empty(96, 40).t(), native=native)


@pytest.mark.skipif(qgemm._pack_lib() is None, reason="no C compiler here")
@pytest.mark.parametrize("kind", KINDS)
def test_the_c_rounding_writes_what_the_torch_path_does(kind: str) -> None:
    """Codes, fp16 scales and the encoded values, bit for bit, over magnitudes from
    subnormal to large, in rows of both signs and blocks with a value exactly half a step."""
    torch.manual_seed(1)
    w = torch.randn(300, 256) * torch.logspace(-20, 3, 300)[:, None]
    w[::7] = w[::7].abs()
    w[1, :32] = torch.arange(32) * 0.5  # codes landing on halves
    got_v, want_v = torch.empty_like(w), torch.empty_like(w)
    got = qgemm.quantize(w, kind, got_v)
    want = qgemm.quantize(w, kind, want_v, native=False)
    assert got is not None and want is not None
    assert torch.equal(got.q, want.q) and torch.equal(
        got.d.view(torch.int16), want.d.view(torch.int16)
    )
    assert (got.m is None) == (want.m is None)
    if got.m is not None:
        assert torch.equal(got.m.view(torch.int16), want.m.view(torch.int16))
    assert torch.equal(got_v.view(torch.int32), want_v.view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_the_kernel_computes_the_rounded_weight(kind: str, rows: int) -> None:
    w, b = _weight(), torch.randn(40)
    packed = qgemm.quantize(w, kind)
    assert packed is not None
    x = torch.randn(rows, 96)
    got = qgemm.linear(x, qgemm.lin_blocks(packed, b))
    if got is None:
        pytest.skip("the block kernels do not build here")
    w_q = packed.dequantize().double()
    want = F.linear(x.double(), w_q, b.double())
    # fp32 sums of 96 exact products: a few ulps of the sum of their magnitudes
    bound = 1e-6 * (F.linear(x.double().abs(), w_q.abs(), b.double().abs()) + 1)
    assert ((got.double() - want).abs() <= bound).all()


def _rounded_reference(path: Path, kind: str) -> Any:
    """transformers' fp32 model with every linear weight (and the LM head, untied from
    the embeddings, which stay as they are) rounded as the method rounds them; an MoE's
    experts (transformers keeps them stacked, [experts, out, in]) each as a linear, its
    router as it is (actorlm keeps routers in full precision)."""
    model = hf_model(path)

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        packed = qgemm.quantize(weight, kind)
        assert packed is not None
        return packed.dequantize()

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not model.lm_head:
                module.weight.copy_(rounded(module.weight))
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for e in range(param.shape[0]):
                    param[e].copy_(rounded(param[e]))
        head = rounded(model.lm_head.weight.detach()).clone()
        model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    return model


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tied", [True, False])
def test_method_matches_transformers_on_the_rounded_weights(
    kind: str, tied: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    path = tiny_model_factory("llama", tie_word_embeddings=tied)
    runner = make_runner(path, quantization=kind)
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * runner.info.num_layers + 1  # qkv, o, gate_up, down; the head
    assert {m.packed.kind for m in layers} == {kind}
    assert runner.fused is not None  # decode steps run the blocks as one native call
    assert_matches_hf(runner, _rounded_reference(path, kind), [PROMPT, [5, 17, 923, 4, 88], [42]])


@pytest.mark.parametrize("kind", KINDS)
def test_moe_experts_are_rounded_like_any_linear(
    kind: str, family_model_factory: Callable[..., Path]
) -> None:
    path = family_model_factory("mixtral")
    runner = make_runner(path, quantization=kind)
    experts = [
        m for n, m in runner.model.named_modules() if isinstance(m, GatedMLP) and ".experts." in n
    ]
    assert len(experts) == 8 * runner.info.num_layers
    assert all(isinstance(m.gate_up_proj, GGUFLinear) for m in experts)
    assert all(isinstance(m.down_proj, GGUFLinear) for m in experts)
    assert_matches_hf(runner, _rounded_reference(path, kind), [PROMPT, [5, 17, 923, 4, 88], [42]])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_against_transformers_on_the_rounded_weights(
    kind: str, fused: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    """The prompt and 16 decode steps in bfloat16 (fed transformers' bf16 greedy tokens),
    held to fp32 transformers on the rounded weights: no farther from it than
    transformers' own bf16 model is, within 1.5x (on this random model its bf16 logits
    lie 4-6% of scale from fp32, ours 1.05-1.15x as far), and its argmax wherever its
    top two are clear."""
    path = tiny_model_factory("llama")
    fp32 = _rounded_reference(path, kind)
    tokens, want = hf_greedy_logits(copy.deepcopy(fp32).to(torch.bfloat16), PROMPT, STEPS)
    got = forced_logits(path, kind, PROMPT, tokens, fused)
    with torch.inference_mode():
        ref = fp32(input_ids=torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    ours, theirs = (got - ref).abs().max().item(), (want - ref).abs().max().item()
    assert ours <= 1.5 * theirs, (ours, theirs)
    scale = want.abs().max().item()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * scale
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_the_method_runs_on_the_cpu_in_float32_or_bfloat16() -> None:
    method = Q8_0Method()
    method.check(torch.device("cpu"), torch.bfloat16)
    for device, dtype in [("cuda", torch.bfloat16), ("cpu", torch.float16)]:
        with pytest.raises(ValueError, match="runs on the CPU in float32 or bfloat16"):
            method.check(torch.device(device), dtype)


def test_a_dense_checkpoint_under_gguf_points_at_the_block_methods(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="actorlm.gpu.runner"):
        make_runner(tiny_llama, quantization="gguf")
        hinted = "--quantization q8_0 or q4_1" in caplog.text
        caplog.clear()
        make_runner(tiny_llama, quantization="q4_1")
    assert hinted
    assert "--quantization q8_0 or q4_1" not in caplog.text
