"""Decode attention over the paged KV pool, alone: the fused step's kernel
(``actorlm_paged_decode_kv`` in ``gpu/kernels/cpu_step.c``, one call a layer as the step
makes it) in each ISA build this CPU runs, against the bytes it must read.

A decode step reads every cached token's K and V of every layer once; at 32 sequences
over ~300 tokens that is ~220 MB on the default model's shape, more than its weights.
Each layer gets a pool of its own (``--layers`` of them, the model's count by
default), so the working set is the model's and comes from memory as in a served step,
and its pages are scattered over the pool in runs of consecutive ids (``--pages runs:8``,
as decodes take them on a CPU, ``--decode-page-run``), one by one (``scattered``, as
they did before), or each sequence's in order (``sequential``). Between steps a buffer larger
than the last-level cache is read (``--flush-mb``), as a served step's weights pass
through the caches between two steps' attention. Beside each figure: the same
calls with every sequence reading the first one's pages of one layer (``hot``: what
the arithmetic costs when the core's own caches hold the KV), and the bytes over the
read bandwidth measured in the same run (``limit``).

    python bench/attention.py                                   # the default model's shape
    python bench/attention.py --batch-sizes 8,32 --context-lens 300,1000 --isas amx,avx512
    python bench/attention.py --heads 16 --kv-heads 8 --head-dim 128 --layers 28   # Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/attention.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.gpu.kernels import native  # noqa: E402
from actorlm.gpu.kernels.step import native_step  # noqa: E402

from bench import machine  # noqa: E402

__all__ = ["Shape", "kv_bytes", "measure", "page_run"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """One measurement's shape: B sequences over ``context`` tokens each, a model's heads."""

    batch: int
    context: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    page_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}"
            )


def kv_bytes(s: Shape) -> int:
    """The bytes of K and V a decode step reads over all layers."""
    esize = torch.empty(0, dtype=_DTYPES[s.dtype]).element_size()
    return 2 * s.layers * s.batch * s.context * s.kv_heads * s.head_dim * esize


def page_run(pages: str) -> int:
    """``--pages`` as the length of the runs of consecutive page ids (0: sequential)."""
    if pages in ("scattered", "sequential"):
        return int(pages == "scattered")
    kind, _, n = pages.partition(":")
    if kind != "runs" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"--pages {pages!r}: scattered, sequential or runs:N (N >= 1)")
    return int(n)


def _pools(s: Shape, run: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each layer's K and V pool [2, kv_heads, pages, page_size, head_dim] and the page
    tables [batch, pages a sequence]: runs of ``run`` consecutive ids in a random order,
    dealt to the sequences in turn as decodes side by side take them (0: in order)."""
    per_seq = -(-s.context // s.page_size)
    gen = torch.Generator().manual_seed(seed)
    if run == 0:
        table = torch.arange(s.batch * per_seq).view(s.batch, per_seq)
    else:
        runs = -(-per_seq // run)  # a sequence's
        starts = torch.randperm(s.batch * runs, generator=gen).view(runs, s.batch).t() * run
        table = (starts[:, :, None] + torch.arange(run)).reshape(s.batch, -1)[:, :per_seq]
    pages = int(table.max()) + 1
    pools = [
        torch.randn(2, s.kv_heads, pages, s.page_size, s.head_dim, generator=gen).to(
            _DTYPES[s.dtype]
        )
        for _ in range(s.layers)
    ]
    return pools, table.contiguous()


def measure(s: Shape, isa: str, threads: int, steps: int, run: int = 1,
            flush: torch.Tensor | None = None, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Median ms of a step's attention (all layers), from memory (``flush`` read before
    each step) and hot."""
    lib = native_step(isa)
    if lib is None:
        raise RuntimeError(f"the {isa} build of cpu_step.c could not be made here")
    fn = lib.actorlm_paged_decode_kv
    pools, table = _pools(s, run, seed)
    G, D = s.heads // s.kv_heads, s.head_dim
    q = torch.randn(s.batch, s.heads * D, generator=torch.Generator().manual_seed(seed + 1))
    out = torch.empty_like(q)
    lens = torch.full((s.batch,), s.context, dtype=torch.int64)
    pages = pools[0].shape[2]
    bf16 = int(s.dtype == "bfloat16")

    one = table[:1].expand_as(table).contiguous()  # every sequence on the first's pages

    def call(pool: torch.Tensor, table: torch.Tensor) -> None:
        rc = fn(
            q.data_ptr(), q.stride(0), pool[0].data_ptr(), pool[1].data_ptr(), bf16, pages,
            table.data_ptr(), table.stride(0), lens.data_ptr(), None, out.data_ptr(), s.batch,
            s.kv_heads, G, D, s.page_size, s.context, D**-0.5, ctypes.c_float(0.0), None, None,
            None, 0, threads,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"actorlm_paged_decode_kv returned {rc}")

    def step_ms(hot: bool) -> float:
        times = []
        for _ in range(steps + 2):  # two to warm up
            if flush is not None and not hot:
                flush.sum()
            t0 = time.perf_counter()
            for layer in range(s.layers):
                call(pools[0], one) if hot else call(pools[layer], table)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3

    return {"ms": step_ms(False), "hot_ms": step_ms(True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--context-lens", default="300,1000")
    p.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtypes", default="bfloat16", help="KV dtypes: bfloat16, float32")
    p.add_argument("--isas", default="", help="ISA builds (default: every one this CPU runs)")
    p.add_argument(
        "--pages", default="runs:8", help="scattered, sequential or runs:N (default runs:8)"
    )
    p.add_argument("--threads", type=int, default=0, help="default: every core")
    p.add_argument(
        "--flush-mb", type=int, default=512, help="read between steps (0: none; default 512)"
    )
    p.add_argument("--steps", type=int, default=20, help="steps timed a measurement")
    p.add_argument("--out", default="bench/results/attention.json", help="raw results (JSON)")
    return p.parse_args(argv)


def table(results: dict[str, Any]) -> str:
    gbs = results["read_bandwidth"] / 1e9
    lines = [
        f"Decode attention, {results['machine']['cpu']}, {results['threads']} threads, "
        f"pages {results['args']['pages']}, {results['args']['flush_mb']} MB read between "
        f"steps; read bandwidth {gbs:.1f} GB/s",
        "",
        "| ISA | KV | batch | context | MB a step | ms a step | hot ms | GB/s | limit ms | "
        "actual / limit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        limit = r["bytes"] / results["read_bandwidth"] * 1e3
        lines.append(
            f"| {r['isa']} | {r['dtype']} | {r['batch']} | {r['context']} | "
            f"{r['bytes'] / 1e6:.1f} | {r['ms']:.2f} | {r['hot_ms']:.2f} | "
            f"{r['bytes'] / r['ms'] / 1e6:.1f} | {limit:.2f} | {r['ms'] / limit:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        run = page_run(args.pages)
    except ValueError as e:
        raise SystemExit(f"bench/attention.py: {e}") from None
    threads = args.threads or torch.get_num_threads()
    runs_on = [i.name for i in native.supported_isas(native.cpu_flags())]
    isas = [i for i in args.isas.split(",") if i] or runs_on[:-1] or runs_on  # generic last
    missing = [i for i in isas if i not in runs_on]
    if missing:
        raise SystemExit(f"bench/attention.py: this CPU does not run {', '.join(missing)}")
    results: dict[str, Any] = {
        "machine": machine.describe(),
        "args": vars(args),
        "threads": threads,
        "read_bandwidth": machine.read_bandwidth(),
        "runs": [],
    }
    flush = torch.ones(args.flush_mb << 18) if args.flush_mb > 0 else None  # 4-byte floats
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for context in (int(c) for c in args.context_lens.split(",")):
                shape = Shape(batch, context, args.heads, args.kv_heads, args.head_dim,
                              args.layers, args.page_size, dtype)  # fmt: skip
                for isa in isas:
                    got = measure(shape, isa, threads, args.steps, run, flush)
                    results["runs"].append(
                        {
                            "isa": isa,
                            "dtype": dtype,
                            "batch": batch,
                            "context": context,
                            "bytes": kv_bytes(shape),
                            **got,
                        }  # fmt: skip
                    )
    machine.save(results, table(results), args.out)
    return results


if __name__ == "__main__":
    main()
