"""What the actor pipeline adds to a decode step: one stream through an in-process
``Engine`` beside the bare forward step of the same model, per setting.

A single greedy request (``--prompt-len`` token ids, ``--new-tokens`` out, ignore_eos)
runs ``--repeats`` times for each setting of overlap scheduling and ``--stream-interval``;
each run gives the time a token (first token to last, over the tokens between) and,
from ``/proc`` (``bench/processes.actor_cpu_seconds``), the CPU seconds a token of every actor process and of this one (the
engine's client). The bare step is ``bench/forward.py``'s decode at batch 1 over the
same context. On a machine whose worker threads hold every core, the other actors'
per-message CPU is what the pipeline adds.

    python bench/pipeline.py                      # overlap on/off x interval 1, 4
    python bench/pipeline.py --num-threads 1 --worker-cpus 0   # a core left to the actors
    python bench/pipeline.py --intervals 1,2,4,8 --overlap on
    python bench/pipeline.py --transports unix,ipc --overlap on --intervals 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/pipeline.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm import Engine  # noqa: E402

from bench import machine  # noqa: E402
from bench.processes import actor_cpu_seconds  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompt-len", type=int, default=275)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--intervals", default="1,4", help="--stream-interval values")
    p.add_argument("--overlap", default="on,off", help="overlap scheduling settings")
    p.add_argument(
        "--transports", default="unix", help="how the actors talk (actorlm's --transport values)"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="the worker's threads (default: actorlm's, every core); fewer leave cores to "
        "the actors around it",
    )
    p.add_argument(
        "--worker-cpus", default="", help="CPUs to pin the worker to (actorlm's --worker-cpus)"
    )
    p.add_argument("--out", default="bench/results/pipeline.json")
    return p.parse_args()


def run(args: argparse.Namespace, transport: str, overlap: bool, interval: int) -> dict[str, Any]:
    ids = list(range(1000, 1000 + args.prompt_len))
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    options: dict[str, Any] = {
        "transport": transport,
        "stream_interval": interval,
        "disable_overlap_schedule": not overlap,
    }
    if args.num_threads:
        options["num_threads"] = args.num_threads
    if args.worker_cpus:
        options["worker_cpus"] = [args.worker_cpus]
    runs = []
    with Engine(**options) as eng:

        async def one() -> tuple[int, float]:
            tokens, first, last = 0, 0.0, 0.0
            async for delta in eng.stream(ids, params):
                if not tokens:
                    first = time.perf_counter()
                tokens += len(delta.token_ids)
                last = time.perf_counter()
            return tokens, last - first

        asyncio.run(one())  # warm-up
        for _ in range(args.repeats):
            before = actor_cpu_seconds(os.getpid())  # this process (the client) as 'serve'
            tokens, span = asyncio.run(one())
            after = actor_cpu_seconds(os.getpid())
            runs.append(
                {
                    "ms_per_token": span / (tokens - 1) * 1e3,
                    "cpu_ms_per_token": {
                        k: (after[k] - before.get(k, 0.0)) / tokens * 1e3 for k in after
                    },
                }
            )
    return {"transport": transport, "overlap": overlap, "stream_interval": interval, "runs": runs}


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {"machine": machine.describe(), "args": vars(args), "setups": []}
    for overlap in (o == "on" for o in args.overlap.split(",")):
        for interval in (int(x) for x in args.intervals.split(",")):
            for transport in args.transports.split(","):
                results["setups"].append(run(args, transport, overlap, interval))
    m = results["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}")
    print(
        "| transport | overlap | stream interval | ms a token (p50 of runs)"
        " | CPU ms a token: tokenizer / scheduler / client |"
    )
    print("| --- | --- | ---: | ---: | --- |")
    for s in results["setups"]:
        ms = statistics.median(r["ms_per_token"] for r in s["runs"])
        cpu = {
            k: statistics.median(r["cpu_ms_per_token"].get(k, 0.0) for r in s["runs"])
            for k in ("tokenizer", "scheduler", "serve")
        }
        print(
            f"| {s['transport']} | {'on' if s['overlap'] else 'off'} | {s['stream_interval']} | {ms:.2f} | {cpu['tokenizer']:.2f} / {cpu['scheduler']:.2f} / {cpu['serve']:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(
        f"\nraw results: {out}  (the bare step: python bench/forward.py --skip-transformers --batch-sizes 1 --context-len {args.prompt_len})"
    )


if __name__ == "__main__":
    main()
