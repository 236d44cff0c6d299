"""A short prompt behind a long one: the first token of a request whose prompt is
mostly cached (a follow-up over a shared system prompt) when it arrives while a long
cold prompt is being prefilled in chunks, per scheduling policy, through an
in-process ``Engine``.

Each trial sends a cold prompt of ``--long-len`` fresh token ids, then after
``--delay`` seconds a prompt of the cached ``--system-len`` ids plus ``--tail-len``
fresh ones; it records both requests' time to first token. ``fcfs`` and ``lpm`` let a
prefill that ends within half a step's budget go before a long one being chunked;
``priority`` (every request at the same priority here) keeps admission order, as
every policy did before, so it is the baseline within the run.

    python bench/behind.py                       # fcfs vs priority, 5 trials each
    python bench/behind.py --long-len 4000 --policies fcfs,lpm,priority
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/behind.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm import Engine  # noqa: E402

from bench import machine  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system-len", type=int, default=1024, help="cached prefix, tokens")
    p.add_argument("--tail-len", type=int, default=40, help="the short prompt's new tokens")
    p.add_argument("--long-len", type=int, default=1500, help="the cold prompt, tokens")
    p.add_argument("--delay", type=float, default=0.15, help="seconds between the two")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--policies", default="fcfs,priority")
    p.add_argument("--out", default="bench/results/behind.json")
    return p.parse_args()


async def ttft(eng: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    first = 0.0
    async for _ in eng.stream(ids, params):
        first = first or time.perf_counter() - t0
    return first * 1e3


def run(args: argparse.Namespace, policy: str) -> list[dict[str, float]]:
    system = [1000 + i % 20000 for i in range(args.system_len)]
    trials = []
    with Engine(policy=policy) as eng:

        async def trial(n: int) -> dict[str, float]:
            fresh = 30000 + n * (args.long_len + args.tail_len)
            cold = list(range(fresh, fresh + args.long_len))
            tail = list(range(fresh + args.long_len, fresh + args.long_len + args.tail_len))
            long_task = asyncio.ensure_future(ttft(eng, cold))
            await asyncio.sleep(args.delay)
            short = await ttft(eng, system + tail)
            return {"long_ms": await long_task, "short_ms": short}

        asyncio.run(ttft(eng, system))  # the system prompt cached, the kernels warm
        for n in range(args.trials):
            trials.append(asyncio.run(trial(n)))
    return trials


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {"machine": machine.describe(), "args": vars(args), "policies": {}}
    for policy in args.policies.split(","):
        results["policies"][policy] = run(args, policy)
    m = results["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}")
    print(
        f"{args.tail_len} new tokens over {args.system_len} cached, {args.delay} s after "
        f"a cold prompt of {args.long_len}; TTFT ms, median of {args.trials}\n"
    )
    print("| policy | short prompt TTFT | long prompt TTFT |")
    print("| --- | ---: | ---: |")
    for policy, trials in results["policies"].items():
        short = statistics.median(t["short_ms"] for t in trials)
        long = statistics.median(t["long_ms"] for t in trials)
        print(f"| {policy} | {short:.0f} | {long:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
