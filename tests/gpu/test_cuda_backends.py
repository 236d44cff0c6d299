"""Each CUDA attention backend against the torch backend on the same weights, on a GPU:
the logits of ragged steps (prefill, a chunk over a cached prefix and decodes together),
and greedy tokens checked step by step against the torch backend's logits for the same
prefix (teacher forcing, so one near tie in bf16 cannot derail the rest)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.runner import ModelRunner

from .helpers import Pages, make_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")]
LOGITS_TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # of the logits' largest magnitude
CLEAR_MARGIN = {"float32": 1e-3, "bfloat16": 0.25}  # a top-2 gap no rounding explains
A, B, C = list(range(300, 341)), [9, 8, 7, 6, 5] * 5, [1000, 2000, 3]


@pytest.fixture(scope="module")
def head64_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """Head size 64 (flashinfer's kernels cover 64, 128 and 256)."""
    return tiny_model_factory("llama", hidden_size=256, intermediate_size=512)


def pair(path: Path, backend: str, dtype: str) -> tuple[ModelRunner, ModelRunner]:
    pytest.importorskip(backend)
    opts = dict(device="cuda", dtype=dtype, disable_cuda_graph=True)
    return (
        make_runner(path, attention_backend="torch", **opts),
        make_runner(path, attention_backend=backend, **opts),
    )


def ragged_logits(runner: ModelRunner) -> torch.Tensor:
    """Three steps with fixed next tokens, so both runners run exactly the same batches."""
    pages = Pages()
    ta, tb, tc = (
        pages.table("a", len(A) + 2),
        pages.table("b", len(B)),
        pages.table("c", len(C) + 1),
    )
    first = runner.run([SeqSpec(A, 0, ta), SeqSpec(B[:17], 0, tb, sample=False)])
    second = runner.run([SeqSpec(B[17:], 17, tb), SeqSpec([77], len(A), ta), SeqSpec(C, 0, tc)])
    third = runner.run([SeqSpec([78], len(A) + 1, ta), SeqSpec([79], len(C), tc)])
    return torch.cat([first, second, third])


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_ragged_logits_match_torch_backend(backend: str, dtype: str, head64_llama: Path) -> None:
    ref, ours = pair(head64_llama, backend, dtype)
    want, got = ragged_logits(ref), ragged_logits(ours)
    assert got.shape == want.shape == (6, ref.info.vocab_size)
    assert (got - want).abs().max().item() < LOGITS_TOL[dtype] * want.abs().max().item()


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_greedy_tokens_match_torch_backend(backend: str, dtype: str, head64_llama: Path) -> None:
    ref, ours = pair(head64_llama, backend, dtype)
    tokens, disagree = list(A), []
    p_ours, p_ref = Pages(), Pages()
    lo = ours.run([SeqSpec(tokens, 0, p_ours.table("g", len(tokens)))])[0]
    lr = ref.run([SeqSpec(tokens, 0, p_ref.table("g", len(tokens)))])[0]
    for step in range(32):
        tok = int(lo.argmax())
        top = lr.topk(2).values
        if int(lr.argmax()) != tok and (top[0] - top[1]).item() > CLEAR_MARGIN[dtype]:
            disagree.append(step)
        tokens.append(tok)
        n = len(tokens)
        lo = ours.run([SeqSpec([tok], n - 1, p_ours.table("g", n))])[0]
        lr = ref.run([SeqSpec([tok], n - 1, p_ref.table("g", n))])[0]
    assert disagree == []
