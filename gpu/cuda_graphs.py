"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step at batch 1 of an 8B model launches ~600 kernels that each run for a few
microseconds; replaying a graph launches them all at once. A step of ``n`` decodes
replays the graph of the smallest captured size ``>= n``, padded with dummy decodes
that write their K/V into a page no sequence owns (the runner allocates the pool one
page larger for them) and whose logits are dropped.

What a graph reads never moves: token ids, positions and KV slots live in fixed device
buffers filled from a pinned host buffer with one non-blocking copy, and the attention
backend refills its own fixed buffers (``init_graph_state``,
``init_forward_metadata_graph``) before each replay. Backends without those methods
(torch) run eagerly.

The pure parts (sizes, bucket choice, padding) import no CUDA and are tested on the CPU;
the rest runs only where ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .forward_meta import ForwardMeta, SeqSpec

__all__ = [
    "CudaGraphRunner",
    "GraphBackend",
    "capture_decode_graphs",
    "capture_sizes",
    "graphable",
    "pad_decodes",
    "pick_size",
    "use_cuda_graphs",
]

log = logging.getLogger(__name__)


@runtime_checkable
class GraphBackend(Protocol):
    """What an attention backend adds to run inside a captured decode step."""

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        """Allocate fixed buffers for up to ``max_bs`` decodes of ``max_pages`` pages each."""

    def init_forward_metadata_graph(self, meta: ForwardMeta, bs: int) -> None:
        """Fill those buffers for ``meta`` (``bs`` decodes) and point ``meta.attn`` at them."""


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself): a batch
    pads by at most 7 rows, and ~40 graphs cover 256."""
    if max_bs < 1:
        return []
    small = [s for s in (1, 2, 4) if s < max_bs]
    return sorted({*small, *range(8, max_bs, 8), max_bs})


def pick_size(bs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``bs`` rows, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if bs > 0 and i < len(sizes) else None


def graphable(seqs: Sequence[SeqSpec]) -> bool:
    """A step a decode graph can run: one new token per sequence, every one sampled."""
    return bool(seqs) and all(len(s.input_ids) == 1 and s.sample for s in seqs)


def pad_decodes(seqs: Sequence[SeqSpec], size: int, pad_page: int) -> list[SeqSpec]:
    """``seqs`` and ``size - len(seqs)`` dummy decodes: token 0 at position 0 of page
    ``pad_page``, which they all share (their writes land there and nowhere else)."""
    if len(seqs) > size:
        raise ValueError(f"{len(seqs)} sequences do not fit a graph of {size}")
    return [*seqs, *[SeqSpec([0], 0, [pad_page])] * (size - len(seqs))]


class CudaGraphRunner:
    def __init__(
        self,
        model: Any,
        backend: GraphBackend,
        page_size: int,
        max_seq_len: int,
        pad_page: int,
        max_bs: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.page_size, self.max_seq_len, self.pad_page = page_size, max_seq_len, pad_page
        self.sizes = capture_sizes(max_bs)
        self.device = device
        backend.init_graph_state(max_bs, -(-max_seq_len // page_size))
        # token ids | positions | KV slots, one row each
        self._inputs = torch.zeros(3, max_bs, dtype=torch.long, device=device)
        self._staging = torch.zeros(3, max_bs, dtype=torch.long).pin_memory()
        self._copied: torch.cuda.Event | None = None
        self._rows = torch.arange(max_bs, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _meta(self, seqs: list[SeqSpec]) -> ForwardMeta:
        bs = len(seqs)
        host = ForwardMeta.build(seqs, self.page_size)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy is done reading
        for row, values in enumerate((host.input_ids, host.positions, host.out_cache_loc)):
            self._staging[row, :bs] = values
        # one copy of the whole block (straight from pinned memory); the rows past ``bs``
        # carry stale values that no graph of this size reads
        self._inputs.copy_(self._staging, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        meta = ForwardMeta(
            input_ids=self._inputs[0, :bs],
            positions=self._inputs[1, :bs],
            out_cache_loc=self._inputs[2, :bs],
            sample_rows=self._rows[:bs],
            start_pos=host.start_pos,
            extend_lens=host.extend_lens,
            row_starts=host.row_starts,
            page_tables=host.page_tables,
            page_size=self.page_size,
            max_seq_len=self.max_seq_len,  # what a captured RoPE table lookup must cover
        )
        self.backend.init_forward_metadata_graph(meta, bs)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # the largest first: the rest reuse its memory
            meta = self._meta(pad_decodes([], bs, self.pad_page))
            self.model(meta, self.backend)  # compiles Triton kernels, sets up cuBLAS
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bs] = self.model(meta, self.backend)
            self._graphs[bs] = graph
        torch.cuda.synchronize()
        log.info(
            "CUDA graphs: %d decode sizes up to %d captured in %.1f s",
            len(self.sizes),
            self.sizes[-1] if self.sizes else 0,
            time.perf_counter() - t0,
        )

    def can_run(self, seqs: Sequence[SeqSpec]) -> bool:
        return graphable(seqs) and pick_size(len(seqs), self.sizes) in self._graphs

    def replay_again(self, n: int) -> None:
        """Replay the graph that runs ``n`` decodes on its buffers as they are, refilling
        nothing (the last step's inputs again): what a step costs the device without
        the host's share (``bench/gpu.py``'s replay column). It writes the last step's
        K/V slots again, so call it before anything else writes there."""
        bs = pick_size(n, self.sizes)
        if bs is None or bs not in self._graphs:
            raise ValueError(f"no graph runs {n} decodes")
        self._graphs[bs].replay()

    def run(self, seqs: Sequence[SeqSpec]) -> torch.Tensor:
        """Logits [len(seqs), V] fp32, a copy (the graph's output buffer is reused)."""
        n = len(seqs)
        bs = pick_size(n, self.sizes)
        assert bs is not None
        self._meta(pad_decodes(seqs, bs, self.pad_page))
        self._graphs[bs].replay()
        return self._logits[bs][:n].clone()


def use_cuda_graphs(cfg: Any, device: torch.device, platform: Any) -> bool:
    """Whether the runner should capture decode graphs (its pool then gets a pad page)."""
    return device.type == "cuda" and platform.supports_graphs() and not cfg.disable_cuda_graph


def capture_decode_graphs(runner: Any, max_seq_len: int, pad_page: int) -> CudaGraphRunner | None:
    """The runner's decode graphs, captured; None (eager decodes) where they cannot work."""
    backend, model = runner.backend, runner.model
    if not isinstance(backend, GraphBackend):
        log.info("CUDA graphs off: attention backend %s runs eagerly", runner.attention_backend)
        return None
    rope = getattr(model, "rope", None)
    if getattr(rope, "kind", "") == "dynamic" and max_seq_len > getattr(rope, "max_pos", 0):
        # dynamic NTK RoPE recomputes its table on the host from each step's length
        log.info("CUDA graphs off: dynamic RoPE scaling past the trained context")
        return None
    from .platforms import MAX_GRAPH_BATCH

    graphs = CudaGraphRunner(
        model,
        backend,
        runner.pool.page_size,
        max_seq_len,
        pad_page,
        runner.cfg.cuda_graph_max_bs or MAX_GRAPH_BATCH,
        runner.device,
    )
    graphs.capture()
    return graphs
