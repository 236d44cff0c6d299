"""CUDA graphs for decode steps: the pure parts (captured sizes, the bucket a batch takes,
padding) everywhere; capture and replay against eager steps where there is a GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from actorlm.config import ModelConfig
from actorlm.gpu.cuda_graphs import (
    capture_sizes,
    graphable,
    pad_decodes,
    pick_size,
    use_cuda_graphs,
)
from actorlm.gpu.cuda_step import upload_meta
from actorlm.gpu.forward_meta import ForwardMeta, SeqSpec
from actorlm.gpu.platforms import CpuPlatform, CudaPlatform
from actorlm.gpu.runner import ModelRunner

from .helpers import Pages, Seq, make_runner, run_step


def test_capture_sizes() -> None:
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5] and capture_sizes(1) == [1] and capture_sizes(0) == []


def test_a_batch_takes_the_smallest_size_that_holds_it() -> None:
    sizes = capture_sizes(64)
    assert [pick_size(n, sizes) for n in (1, 3, 4, 5, 9, 64)] == [1, 4, 4, 8, 16, 64]
    assert pick_size(65, sizes) is None and pick_size(0, sizes) is None


def test_padding_rows_write_only_the_pad_page() -> None:
    seqs = [SeqSpec([5], 17, [3, 9]), SeqSpec([6], 0, [4])]
    padded = pad_decodes(seqs, 4, pad_page=99)
    assert padded[:2] == seqs and padded[2:] == [SeqSpec([0], 0, [99])] * 2
    meta = ForwardMeta.build(padded, 16)
    assert meta.out_cache_loc.tolist() == [9 * 16 + 1, 4 * 16, 99 * 16, 99 * 16]
    assert meta.sample_rows.tolist() == [0, 1, 2, 3]  # every row has logits: a fixed shape
    with pytest.raises(ValueError, match="do not fit"):
        pad_decodes(seqs, 1, 99)


def test_only_decode_steps_are_graphed() -> None:
    assert graphable([SeqSpec([1], 4, [0]), SeqSpec([2], 9, [1])])
    assert not graphable([SeqSpec([1, 2], 0, [0])])  # a prefill
    assert not graphable([SeqSpec([1], 4, [0], sample=False)])
    assert not graphable([])


def test_graphs_only_on_cuda_and_when_not_disabled() -> None:
    on, off = ModelConfig(), ModelConfig(disable_cuda_graph=True)
    assert not use_cuda_graphs(on, torch.device("cpu"), CpuPlatform())
    assert use_cuda_graphs(on, torch.device("cuda"), CudaPlatform())
    assert not use_cuda_graphs(off, torch.device("cuda"), CudaPlatform())


def test_upload_keeps_the_step() -> None:
    meta = ForwardMeta.build([SeqSpec([7, 8], 3, [2]), SeqSpec([9], 0, [5])], 16)
    moved = upload_meta(meta, torch.device("cpu"))
    for name in ("input_ids", "positions", "out_cache_loc", "sample_rows"):
        assert torch.equal(getattr(moved, name), getattr(meta, name))
    assert moved.page_tables == meta.page_tables


def _decode_run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    pages = Pages()
    seqs = [Seq(f"r{i}", p, pages) for i, p in enumerate(prompts)]
    run_step(runner, seqs, [s.step() for s in seqs])  # one prefill step, eager
    for i in range(steps):
        run_step(runner, seqs, [s.step() for s in seqs], i + 1)  # decodes: graphs
    return [s.out for s in seqs]


@pytest.fixture(scope="module")
def head64_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny Llama with head size 64 (flashinfer has kernels for 64, 128, 256)."""
    return tiny_model_factory("llama", hidden_size=256, intermediate_size=512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")],
)
def test_graph_replay_gives_the_eager_tokens(backend: str, dtype: str, head64_llama: Path) -> None:
    pytest.importorskip(backend)
    opts = dict(device="cuda", dtype=dtype, attention_backend=backend, cuda_graph_max_bs=8)
    graphed = make_runner(head64_llama, **opts)
    eager = make_runner(head64_llama, disable_cuda_graph=True, **opts)
    assert graphed.graphs is not None and eager.graphs is None
    prompts = [list(range(100, 140)), [5, 6, 7] * 7, [42]]  # 3 decodes replay the graph of 4
    assert _decode_run(graphed, prompts, 16) == _decode_run(eager, prompts, 16)
    # one replayed step's logits against the same step run eagerly (both pools hold the
    # same K/V now)
    step = [SeqSpec([7], 40, [0, 1, 2]), SeqSpec([8], 21, [3, 4])]
    assert graphed.graphs.can_run(step)
    diff = (graphed.run(step) - eager.run(step)).abs().max().item()
    assert diff < (1e-4 if dtype == "float32" else 5e-2)
