"""Chaos: ``actorlm serve`` under mixed load and malformed requests while a random
process (an actor or the gateway) is killed every 30-60 s.

    python bench/chaos.py --duration 600            # the issue's 10 minutes
    python bench/chaos.py --duration 120 --model DIR # a quick look

Reports requests ok / failed with a clear error / failed otherwise, 5xx answers to
bad input, recovery time per killed role (until /health is 200 again), KV pages
leaked once the load stops, and each process's RSS at the end of the first minute
and at the end. Writes the table (printed) and the raw results to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.chaos_inputs import bad_request  # noqa: E402

__all__ = ["main"]

ROLES = ("gateway", "tokenizer", "scheduler", "cache_manager", "worker")


def role_pids(parent: int) -> dict[str, int]:
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        mark = b"actorlm.actors.runtime.child"
        if ppid == parent and mark in argv:
            out[argv[argv.index(mark) + 1].decode()] = int(entry.name)
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # valid requests
    bad: Counter[str] = field(default_factory=Counter)  # malformed requests, by status class
    bad_5xx: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)


async def _valid(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    stream = rng.random() < 0.5
    kind = rng.randrange(3)
    n = rng.randint(4, 48)
    if kind == 0:
        path, body = "/v1/completions", {"prompt": "Tell me a story about", "max_tokens": n}
    elif kind == 1:
        messages = [{"role": "user", "content": "Name a few colours."}]
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": n}
    else:
        path, body = "/generate", {"text": "The sky is", "sampling_params": {"max_new_tokens": n}}
    body["stream"] = stream
    abort_after = rng.randint(1, 4) if stream and rng.random() < 0.2 else 0
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(120)) as resp:
            if resp.status != 200:
                text = await resp.text()
                clear = resp.status < 600 and '"error"' in text
                tally.outcomes["clear error" if clear else f"unclear {resp.status}"] += 1
                return
            if not stream:
                await resp.json()
                tally.outcomes["ok"] += 1
                return
            events = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events += 1
                    if b'"error"' in line:
                        tally.outcomes["clear error"] += 1
                        return
                    if abort_after and events >= abort_after:
                        tally.outcomes["aborted by the client"] += 1
                        return  # leaving the context closes the connection: an abort
            tally.outcomes["ok"] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        tally.outcomes[f"connection: {type(exc).__name__}"] += 1


async def _bad(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally) -> None:
    path, data, headers = bad_request(rng)
    headers = {"Content-Type": "application/json", **headers}
    try:
        async with session.post(url + path, data=data, headers=headers) as resp:
            await resp.read()
            tally.bad[f"{resp.status // 100}xx"] += 1
            if resp.status >= 500 and resp.status != 503:  # 503: an actor was restarting
                tally.bad_5xx.append(
                    {
                        "path": path,
                        "status": resp.status,
                        "body": data[:200].decode(errors="replace"),
                    }
                )
    except aiohttp.ClientError as exc:
        tally.bad[f"connection: {type(exc).__name__}"] += 1


async def _health(session: aiohttp.ClientSession, url: str) -> int:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(2)) as resp:
            return resp.status
    except (TimeoutError, aiohttp.ClientError):
        return 0


async def _killer(
    proc: subprocess.Popen[bytes],
    url: str,
    args: argparse.Namespace,
    rng: random.Random,
    tally: Tally,
    stop: asyncio.Event,
) -> None:
    lo, hi = args.kill_every
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), rng.uniform(lo, hi))
                return
            except TimeoutError:
                pass
            role = rng.choice(ROLES)
            before = role_pids(proc.pid).get(role)
            if before is None:
                continue
            os.kill(before, signal.SIGKILL)
            killed = time.monotonic()
            down_seen = False
            while time.monotonic() - killed < 120:
                status = await _health(session, url)
                down_seen |= status != 200
                now = role_pids(proc.pid).get(role)
                if status == 200 and now not in (None, before):
                    break
                await asyncio.sleep(0.05)
            tally.recoveries.append(
                {
                    "role": role,
                    "recovery_s": round(time.monotonic() - killed, 2),
                    "health_went_503": down_seen,
                }
            )
            print(f"  killed {role}: back in {tally.recoveries[-1]['recovery_s']} s", flush=True)


async def _load(url: str, args: argparse.Namespace, tally: Tally, stop: asyncio.Event) -> None:
    async def one(worker: int) -> None:
        rng = random.Random(args.seed * 1000 + worker)
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                if rng.random() < args.bad_fraction:
                    await _bad(session, url, rng, tally)
                else:
                    await _valid(session, url, rng, tally)

    await asyncio.gather(*(one(i) for i in range(args.concurrency)))


async def _run(args: argparse.Namespace, proc: subprocess.Popen[bytes], url: str) -> dict[str, Any]:
    tally, stop = Tally(), asyncio.Event()
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    rss_first: dict[str, float] = {}

    async def sample_rss() -> None:
        await asyncio.sleep(min(60.0, args.duration / 2))
        rss_first.update({r: rss_mb(p) for r, p in role_pids(proc.pid).items()})
        rss_first["supervisor"] = rss_mb(proc.pid)

    tasks = [
        loop.create_task(_load(url, args, tally, stop)),
        loop.create_task(_killer(proc, url, args, rng, tally, stop)),
        loop.create_task(sample_rss()),
    ]
    await asyncio.sleep(args.duration)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    async with aiohttp.ClientSession() as session:
        while (
            time.monotonic() - started < args.duration + 120 and await _health(session, url) != 200
        ):
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # aborted streams give their pages back
        async with session.get(url + "/get_server_info") as resp:
            info = await resp.json()
    rss_end = {r: rss_mb(p) for r, p in role_pids(proc.pid).items()}
    rss_end["supervisor"] = rss_mb(proc.pid)
    cache = info.get("stats", {}).get("cache_manager", {})
    return {
        "outcomes": dict(tally.outcomes),
        "bad_input": dict(tally.bad),
        "bad_input_5xx": tally.bad_5xx[:20],
        "recoveries": tally.recoveries,
        "kv_after": {
            k: cache.get(k)
            for k in (
                "consistent",
                "running_requests",
                "pages_private",
                "pages_used",
                "pages_total",
            )
        },
        "rss_first_minute_mb": rss_first,
        "rss_end_mb": rss_end,
    }


def _table(result: dict[str, Any]) -> str:
    rows = ["| measure | value |", "| --- | --- |"]
    outcomes = result["outcomes"]
    total = sum(outcomes.values())
    for name, count in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        rows.append(f"| valid requests: {name} | {count} of {total} |")
    bad = result["bad_input"]
    rows.append(
        f"| bad requests sent | {sum(bad.values())} ({', '.join(f'{k}: {v}' for k, v in sorted(bad.items()))}) |"
    )
    rows.append(f"| 5xx (not 503) answers to bad input | {len(result['bad_input_5xx'])} |")
    by_role: dict[str, list[float]] = {}
    for rec in result["recoveries"]:
        by_role.setdefault(rec["role"], []).append(rec["recovery_s"])
    for role, times in sorted(by_role.items()):
        rows.append(
            f"| {role} back after a kill (s) | max {max(times):.1f}, each: {', '.join(f'{t:.1f}' for t in times)} |"
        )
    kv = result["kv_after"]
    rows.append(
        f"| KV after the load | consistent={kv['consistent']}, running={kv['running_requests']}, private pages={kv['pages_private']} |"
    )
    first, end = result["rss_first_minute_mb"], result["rss_end_mb"]
    for role in sorted(end):
        a, b = first.get(role, 0.0), end[role]
        growth = f"{100 * (b - a) / a:+.0f}%" if a else "n/a"
        rows.append(f"| RSS {role} (MB) | {a:.0f} -> {b:.0f} ({growth}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=600.0, help="seconds of load (default 600)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument(
        "--bad-fraction", type=float, default=0.7, help="share of malformed requests (default 0.7)"
    )
    parser.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=(30.0, 60.0),
        metavar=("MIN", "MAX"),
        help="seconds between kills (default 30 60)",
    )
    parser.add_argument("--model", default="", help="model to serve (default: the embedded one)")
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--port", str(args.port)]
    if args.model:
        cmd += ["--model", args.model]
    log = Path(args.out).with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                import urllib.request

                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"actorlm serve exited; see {log}")
            time.sleep(0.5)
        print(f"chaos: {args.duration:g}s against {url}", flush=True)
        result = asyncio.run(_run(args, proc, url))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    result.update(
        {
            "args": vars(args),
            "cpu": model,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "cores": os.cpu_count(),
        }
    )
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(_table(result))
    print(f"raw results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
