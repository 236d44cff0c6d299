"""Replicas per core: one replica against two behind the router, and prefill/decode
disaggregation against two colocated replicas.

Each setup is an ``actorlm serve`` of the same model with every replica's worker pinned
to a core of its own (``--worker-cpus``), driven with a seeded workload
(``bench/workloads.py``) at one concurrency. On the shared-prefix workload (groups of
requests sharing a long system prompt):

- ``one``: one replica, its worker on the first core;
- ``cache_aware``: two replicas (first and second core) behind the cache-aware router;
- ``round_robin``: the same two replicas, requests dealt in turn.

On the long-prompt workload (random prompts of ``--long-input-len`` tokens):

- ``colocated``: two replicas, each prefilling and decoding its own requests (least load);
- ``pd``: one decode replica (first core) and one prefill replica (second core): prompts
  with more than ``--max-local-prefill-tokens`` uncached tokens are prefilled there and
  their KV shipped to the decode worker;
- ``pd_queue2``: the same with ``--max-prefill-queue 2``: a long prompt is prefilled on
  the decode replica while the prefill replica holds two already.

The cache hit rate is the server's: prompt tokens served from a replica's prefix cache
over prompt tokens asked, summed over replicas, for the measured requests only (the
caches are flushed after the warm-up). "x first" compares each setup's output
throughput with the first setup of its workload.

    flock /tmp/cpu.lock python bench/disagg.py --num-prompts 48 --concurrency 8
    python bench/disagg.py --setups one,cache_aware,round_robin --concurrency 8 --per-replica --confine

``--per-replica`` gives each setup ``--concurrency`` requests in flight per decode
replica, so two replicas are measured at the load that saturates each as one replica
is; without it every setup gets the same total load, and two replicas each decode
half the batch one replica does. ``--confine`` runs each setup's whole deployment (and
the client) on its workers' cores only, so one replica gets one core in all and two
get two; without it the rest of the deployment takes what the workers leave of every
core, which for one replica is the whole second core.

Writes ``--out`` (JSON; default ``bench/results/disagg.json``) and the Markdown
table beside it (``.md``, also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/disagg.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench import machine, peers  # noqa: E402
from bench.processes import EngineProcess, actor_cpu_seconds, free_port  # noqa: E402
from bench.serving_client import run_level, send_one, wait_ready  # noqa: E402
from bench.serving_metrics import summarize  # noqa: E402
from bench.workloads import (  # noqa: E402
    BenchRequest,
    WorkloadParams,
    build_workload,
    load_tokenizer,
    parse_range,
)

__all__ = ["SETUPS", "hit_rate", "main", "parse_args"]

# name → (decode replicas, router policy, prefill replicas, workload, --max-prefill-queue)
SETUPS: dict[str, tuple[int, str, int, str, int]] = {
    "one": (1, "", 0, "shared", 0),
    "cache_aware": (2, "cache_aware", 0, "shared", 0),
    "round_robin": (2, "round_robin", 0, "shared", 0),
    "colocated": (2, "least_load", 0, "long", 0),
    "pd": (1, "", 1, "long", 0),
    "pd_queue2": (1, "", 1, "long", 2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF or HF folder (default: embedded)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"of {', '.join(SETUPS)}")
    p.add_argument("--cpus", default="0,1", help="the cores the replicas' workers take, in order")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-groups", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    p.add_argument("--question-len", default="32:64")
    p.add_argument("--output-len", default="32")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--confine",
        action="store_true",
        help="run each setup's whole deployment and this client on its workers' cores "
        "only: N replicas on N cores in all (else the rest of one replica has a core free)",
    )
    p.add_argument(
        "--per-replica",
        action="store_true",
        help="scale each setup's concurrency by its decode replicas: the same load a "
        "replica (throughput at a replica's saturation), not the same load in all",
    )
    p.add_argument("--long-prompts", type=int, default=32, help="requests of the long workload")
    p.add_argument("--long-input-len", default="1024:1536")
    p.add_argument("--long-output-len", default="64")
    p.add_argument("--max-local-prefill-tokens", type=int, default=256, help="pd: see serve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "disagg.json")
    return p.parse_args(argv)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return dict(json.loads(r.read()))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


def cache_counts(stats: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(matched, requested) prompt tokens over every replica's cache manager."""
    roles = [r for r in stats if r.split(".")[0] == "cache_manager"]
    matched = sum(int(stats[r].get("prefix_matched_tokens", 0)) for r in roles)
    requested = sum(int(stats[r].get("prefix_requested_tokens", 0)) for r in roles)
    return matched, requested


def hit_rate(before: tuple[int, int], after: tuple[int, int]) -> float:
    asked = after[1] - before[1]
    return (after[0] - before[0]) / asked if asked else 0.0


def run_setup(
    name: str, args: argparse.Namespace, model: Path, cpus: list[str], workload: Any, logs: Path
) -> dict[str, Any]:
    replicas, policy, prefill, _, queue = SETUPS[name]
    load = concurrency(args, replicas)
    workers = cpus[: replicas + prefill]
    port = free_port("127.0.0.1", 31000)
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--dp-size", str(replicas), "--worker-cpus", *workers]
    if policy:
        argv += ["--router-policy", policy]
    if prefill:
        argv += ["--prefill-replicas", str(prefill)]
        argv += ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
        argv += ["--max-prefill-queue", str(queue)]
    saved = os.sched_getaffinity(0)
    if args.confine:  # the server's processes inherit it, and the client runs under it
        os.sched_setaffinity(0, {int(c) for c in workers})
    proc = EngineProcess(argv, {}, logs / f"{name}.log")
    try:
        asyncio.run(wait_ready(url, ("/health",), args.start_timeout, proc.alive))

        async def warm_up() -> None:  # each replica once (distinct prompts: each goes elsewhere)
            import aiohttp

            async with aiohttp.ClientSession() as session:
                for i in range(replicas):
                    warm = BenchRequest(f"Hello number {i}, how are you today?", 8, 4)
                    await send_one(session, url, None, warm, lambda n: {"ignore_eos": True})

        asyncio.run(warm_up())
        _post(f"{url}/flush_cache", {})
        before = cache_counts(_get(f"{url}/get_server_info")["stats"])
        cpu_before = actor_cpu_seconds(proc.proc.pid)
        run = asyncio.run(
            run_level(
                url,
                None,
                workload,
                lambda n: {"ignore_eos": True},
                concurrency=load,
                seed=args.seed,
                progress=False,
                desc=name,
            )
        )
        cpu = actor_cpu_seconds(proc.proc.pid)
        stats = _get(f"{url}/get_server_info")["stats"]
        after = cache_counts(stats)
    finally:
        proc.stop()
        os.sched_setaffinity(0, saved)
    for r in run.results:  # the server's count (usage): exact, whatever the text decodes to
        r.output_tokens = r.server_output_tokens or 0
    summary = summarize(run.results, run.duration or None)
    router = {k: v for k, v in stats.get("tokenizer", {}).items() if k.startswith("router_")}
    pd = {k: v for k, v in stats.get("scheduler", {}).items() if k.startswith("pd_")}
    pd["kv_received_bytes"] = stats.get("worker", {}).get("kv_received_bytes", 0)
    return {
        "setup": name,
        "workload": SETUPS[name][3],
        "replicas": replicas,
        "prefill_replicas": prefill,
        "policy": policy or "-",
        "worker_cpus": workers,
        "concurrency": load,
        "hit_rate": hit_rate(before, after),
        "router": router,
        "pd": pd,
        # CPU seconds each process used during the measured run (the workers pinned, the
        # rest wherever the OS put them)
        "cpu_s": {r: round(s - cpu_before.get(r, 0.0), 2) for r, s in sorted(cpu.items())},
        "summary": summary,
        "requests": [r.to_json() for r in run.results],
    }


def concurrency(args: argparse.Namespace, replicas: int) -> int:
    """Requests in flight for a setup of ``replicas`` decode replicas."""
    return args.concurrency * (replicas if args.per_replica else 1)


def _cpu(row: dict[str, Any]) -> str:
    """CPU seconds the workers used in the run, and the rest of the deployment."""
    cpu = row.get("cpu_s") or {}
    if not cpu:
        return "-"
    workers = sum(s for r, s in cpu.items() if r.split(".")[0] == "worker")
    return f"{workers:.1f} / {sum(cpu.values()) - workers:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    first: dict[str, float] = {}  # workload → the first setup's output throughput
    head = (
        "| workload | setup | replicas (cores) | policy | load | req/s | out tok/s | x first | "
        "TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | cache hit | failed | "
        "CPU s workers / rest |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        s = r["summary"]
        workload = r.get("workload", "shared")
        base = first.setdefault(workload, s["output_throughput"])
        ratio = s["output_throughput"] / base if base else 1.0
        prefill = r.get("prefill_replicas", 0)
        replicas = f"{r['replicas']}+{prefill}P" if prefill else str(r["replicas"])
        lines.append(
            f"| {workload} | {r['setup']} | {replicas} ({','.join(r['worker_cpus'])}) | "
            f"{r['policy']} | c={r.get('concurrency', '?')} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {ratio:.2f} | "
            f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['itl_ms']['p50']:.1f} | "
            f"{s['itl_ms']['p99']:.1f} | {r['hit_rate']:.1%} | {s['failed']} | {_cpu(r)} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or peers.default_gguf()
    gguf = model if model.suffix == ".gguf" else None
    tok = load_tokenizer(None if gguf else model, gguf)
    params = WorkloadParams(
        dataset="shared-prefix",
        num_prompts=args.num_prompts,
        seed=args.seed,
        output_len=parse_range(args.output_len),
        num_groups=args.num_groups,
        system_len=args.system_len,
        question_len=parse_range(args.question_len),
    )
    long = WorkloadParams(
        dataset="random",
        num_prompts=args.long_prompts,
        seed=args.seed,
        input_len=parse_range(args.long_input_len),
        output_len=parse_range(args.long_output_len),
    )
    workloads = {"shared": build_workload(tok, params), "long": build_workload(tok, long)}
    cpus = [c.strip() for c in args.cpus.split(",") if c.strip()]
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or any(SETUPS[s][0] + SETUPS[s][2] > len(cpus) for s in setups):
        print(f"bench/disagg.py: unknown setups {unknown} or too few --cpus", file=sys.stderr)
        return 2
    used = {SETUPS[s][3] for s in setups}
    for key in sorted(used):
        print(f"workload {key}: {workloads[key].describe()}", flush=True)
    logs = args.out.with_name(args.out.stem + "-logs")
    rows = []
    for name in setups:
        t = time.monotonic()
        workload = workloads[SETUPS[name][3]]
        rows.append(run_setup(name, args, model, cpus, workload, logs))
        print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    text = table(rows)
    results = {
        "command": " ".join(sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(with_torch=False),
        "cpu_pressure": machine.cpu_pressure(),
        "model": str(model),
        "workloads": {key: workloads[key].describe() for key in sorted(used)},
        "concurrency": args.concurrency,
        "per_replica": args.per_replica,
        "confine": args.confine,
        "runs": rows,
    }
    machine.save(results, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
