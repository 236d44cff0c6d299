"""The triton backend against the torch backend on ragged paged batches (prefill, extend
and decode in one step): GQA and MHA, head sizes 64, 80 and 128, page sizes 1 and 16,
fp32 and bf16; its CUDA-graph metadata path; and a whole model through it. On the CPU the
kernels run in Triton's interpreter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.interpreter import enable

DEVICE = enable()

from actorlm.extensions.points import ATTENTION_BACKENDS  # noqa: E402
from actorlm.gpu.attention.torch_native import TorchNativeBackend  # noqa: E402
from actorlm.gpu.attention.triton_backend import TritonBackend, num_kv_splits  # noqa: E402
from actorlm.gpu.forward_meta import SeqSpec  # noqa: E402
from actorlm.gpu.runner import ModelRunner  # noqa: E402

from ..helpers import Pages, Seq, greedy, make_runner, run_step  # noqa: E402
from .ragged import MIXED, Step, ragged_step, rebuild  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def run(backend: Any, step: Step) -> torch.Tensor:
    meta = rebuild(step)
    backend.init_forward_metadata(meta)
    return backend.forward(step.q, step.k, step.v, 1, meta)


def compare(step: Step, heads: int, dim: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    want = run(TorchNativeBackend(step.pool, heads, dim), step)
    got = run(TritonBackend(step.pool, heads, dim, interpret=True, **kwargs), step)
    return want.float(), got.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (4, 4, 80), (8, 2, 128)])
def test_matches_torch_backend_on_a_ragged_batch(
    heads: int, kv_heads: int, dim: int, page_size: int, dtype: torch.dtype
) -> None:
    step = ragged_step(MIXED, heads, kv_heads, dim, page_size, dtype, DEVICE)
    want, got = compare(step, heads, dim)
    assert got.shape == (step.meta.num_tokens, heads * dim)
    assert (got - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_kv_splits_do_not_change_decodes(splits: int) -> None:
    # more splits than a short context has keys: the empty ones must drop out of the merge
    step = ragged_step([(0, 1), (2, 1), (300, 1), (64, 1)], 6, 2, 64, 16, torch.float32, DEVICE)
    want, got = compare(step, 6, 64, num_splits=splits)
    assert (got - want).abs().max().item() < 2e-5


def test_peaked_scores_over_long_contexts() -> None:
    # |q.k| in the hundreds: exp2 underflows for most keys in every block and split
    step = ragged_step([(700, 1), (0, 90), (400, 40)], 4, 2, 64, 16, torch.float32, DEVICE)
    step.q.mul_(30.0)
    want, got = compare(step, 4, 64)
    assert (got - want).abs().max().item() < 1e-4


def test_graph_metadata_path_gives_the_eager_result() -> None:
    step = ragged_step([(9, 1), (40, 1), (0, 1)], 4, 2, 64, 16, torch.float32, DEVICE)
    # the same splits both ways (a graph's depend on its batch alone), so equal bits
    ours = TritonBackend(step.pool, 4, 64, interpret=True, num_splits=2)
    eager = run(ours, step)
    ours.init_graph_state(max_bs=8, max_pages=4)
    for _ in range(2):  # a second fill of the same buffers (a replay) changes nothing
        meta = rebuild(step)
        ours.init_forward_metadata_graph(meta, 3)
        assert torch.equal(ours.forward(step.q, step.k, step.v, 1, meta), eager)
    with pytest.raises(ValueError, match="graph step is 3 decodes"):
        ours.init_forward_metadata_graph(
            rebuild(ragged_step([(0, 2)] * 3, 4, 2, 64, 16, torch.float32, DEVICE)), 3
        )


def test_split_counts() -> None:
    # batch 1 over a long context on 132 SMs: split up to the cap; big batches: no split
    assert num_kv_splits(1, 8, 1024, 132) == 4  # 1024 / 256
    assert num_kv_splits(1, 8, 100_000, 132) == 16
    assert num_kv_splits(256, 8, 100_000, 132) == 1
    assert num_kv_splits(3, 2, 10, 4) == 1


def test_refuses_a_cpu_pool_unless_asked_to_interpret() -> None:
    step = ragged_step([(0, 2)], 2, 1, 64, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="triton.*needs a CUDA device"):
        TritonBackend(step.pool, 2, 64)


class _Interpreted(TritonBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, interpret=DEVICE.type == "cpu", **kwargs)


@pytest.fixture(scope="module")
def runners(tiny_llama: Path) -> Iterator[tuple[ModelRunner, ModelRunner]]:
    ATTENTION_BACKENDS.register("triton-test", _Interpreted)
    try:
        opts = {"device": str(DEVICE), "num_pages": 128, "disable_cuda_graph": True}
        yield (
            make_runner(tiny_llama, attention_backend="torch", **opts),
            make_runner(tiny_llama, attention_backend="triton-test", **opts),
        )
    finally:
        ATTENTION_BACKENDS.unregister("triton-test")


def test_model_logits_and_greedy_tokens_match_torch_backend(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    ref, ours = runners
    prompts = [list(range(300, 337)), [9, 8, 7, 6, 5] * 4, [1000, 2000, 3]]
    for runner in runners:
        assert isinstance(runner.backend, TritonBackend) == (runner is ours)
    table = Pages(first=100).table
    batch = [SeqSpec(p, 0, table(f"r{i}", len(p))) for i, p in enumerate(prompts)]
    assert (ours.run(batch) - ref.run(batch)).abs().max().item() < 1e-4
    # chunked prefill, decodes beside an extend, decodes only: the same tokens
    out = []
    for runner in runners:
        pages = Pages()
        a, b = Seq("a", prompts[0], pages), Seq("b", prompts[1], pages)
        run_step(runner, [a], [a.step()])
        run_step(runner, [a, b], [b.step(chunk=9), a.step()])
        run_step(runner, [a, b], [b.step(), a.step()])
        for i in range(6):
            run_step(runner, [a, b], [a.step(), b.step()], 3 + i)
        out.append((a.out, b.out, greedy(runner, "c", prompts[2], 8, Pages(first=60))))
    assert out[0] == out[1]
