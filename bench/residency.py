"""How fast the machine reads a decode step's worth of memory back to back, and how fast
right after something else: the first passes after an idle pause, or after streaming
another buffer (as a prompt's pass over the AMX tiles does), against passes with
nothing between them. On a CPU whose last-level cache holds the buffer, back-to-back
passes read it from that cache; once something evicts it, the next passes read it from
DRAM until the cache has taken it back (a streaming buffer is taken back a part a pass).

Each case: --warm passes over the buffer, then the case's gap, then --passes timed
passes (torch's sum on all cores, as the step's threads read). Several rounds, the
cases interleaved; the median of each pass position is printed.

    python bench/residency.py                    # 100 MiB: ~the default model's decode
    python bench/residency.py --mib 400 --other-mib 800
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/residency.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=100, help="the buffer read each pass")
    p.add_argument("--other-mib", type=int, default=400, help="the buffer streamed between")
    p.add_argument("--gap-ms", type=float, default=50.0, help="the pause and the stream's length")
    p.add_argument("--warm", type=int, default=15, help="passes before each case's gap")
    p.add_argument("--passes", type=int, default=10, help="timed passes after the gap")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/residency.json", help="raw results (JSON)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    buf = torch.ones(args.mib * 2**20 // 4)
    other = torch.ones(args.other_mib * 2**20 // 4)

    def until(seconds: float, work: Callable[[], object]) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            work()

    gap = args.gap_ms / 1e3
    cases: dict[str, Callable[[], None]] = {
        "back to back": lambda: None,
        f"idle {args.gap_ms:.0f} ms": lambda: time.sleep(gap),
        f"idle {args.gap_ms / 10:.0f} ms": lambda: time.sleep(gap / 10),
        f"streaming {args.other_mib} MiB for {args.gap_ms:.0f} ms": lambda: until(gap, other.sum),
        f"reading it for {args.gap_ms:.0f} ms": lambda: until(gap, buf.sum),
    }
    ms: dict[str, list[list[float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, between in cases.items():
            for _ in range(args.warm):
                buf.sum()
            between()
            times = []
            for _ in range(args.passes):
                t0 = time.perf_counter()
                buf.sum()
                times.append((time.perf_counter() - t0) * 1e3)
            ms[name].append(times)
    m = machine.describe()
    flags, threads = " ".join(m["isa_flags"]), torch.get_num_threads()
    print(f"{m['cpu']}, {m['cores']} cores, flags {flags}; {threads} threads")
    print(
        f"\n| {args.mib} MiB: ms a pass after the gap | "
        + " | ".join(str(i + 1) for i in range(args.passes))
        + " |"
    )
    print("| --- |" + " ---: |" * args.passes)
    table = {}
    for name, runs in ms.items():
        table[name] = [statistics.median(r[i] for r in runs) for i in range(args.passes)]
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in table[name]) + " |")
    back = statistics.median(table["back to back"])
    print(f"\nback to back: {args.mib * 2**20 / back / 1e6:.1f} GB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "args": vars(args), "ms": ms, "median_ms": table}))
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
