"""Offline throughput: the Python ``actorlm.Engine`` (no HTTP) beside ``transformers``
``generate`` with static batches, on the same weights, the same seeded requests, in one run.

Workloads (token ids drawn from the model's vocabulary with a fixed seed):

- ``random``: ``--num-requests`` requests, input lengths from ``--input-len``, output
  lengths from ``--output-len``.
- ``shared-prefix``: ``--shared-num-requests`` requests, each one ``--prefix-len``-token
  system prompt (the same for all) plus its own ``--suffix-len`` tokens, with
  ``--shared-output-len`` output tokens. actorlm runs it twice, with the prefix cache on
  and off (a second Engine), and the ratio of their mean time-to-first-token is reported.
  Before timing, each actorlm engine serves one request with the shared prefix (a
  warm-up), so the cache-on engine starts in the steady state of a deployment whose
  system prompt is already cached.

actorlm gets every request at once (``Engine.stream`` from one asyncio loop, so TTFT is
measured per request), greedy with ``ignore_eos`` and ``max_new_tokens``. transformers
runs static batches of ``--hf-batch-size`` in request order (left padding, greedy,
``min_new_tokens = max_new_tokens`` = the longest output in the batch); a request's
output is cut to its own length, so only requested tokens count, and its TTFT is the
time from the start of the run to its batch's first token.

    python bench/offline.py                           # both workloads, ~10 minutes on 2 idle cores
    python bench/offline.py --quick                   # tiny smoke run
    python bench/offline.py --workloads random --skip-transformers

Writes ``--out`` (JSON; default ``bench/results/offline.json``) and the Markdown table
beside it (``.md``, also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/offline.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench.workloads import parse_range  # noqa: E402

WORKLOADS = ("random", "shared-prefix")
RANDOM_TARGET = 3.0  # actorlm output tok/s ÷ transformers static batching, random workload
PREFIX_TARGET = 5.0  # mean TTFT cache off ÷ cache on, shared-prefix workload
ID_MARGIN = 100  # token ids are drawn from [ID_MARGIN, vocab - ID_MARGIN): no special tokens


@dataclass(frozen=True)
class Request:
    input_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    ttft_s: float | None  # from the start of the run
    latency_s: float  # from the start of the run to its last token
    output_ids: list[int]
    cached_tokens: int = 0


@dataclass
class RunResult:
    engine: str
    workload: str
    total_s: float
    requests: list[RequestResult] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


# -- workloads (pure) ----------------------------------------------------------------------
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(ID_MARGIN, vocab - ID_MARGIN) for _ in range(n)]


def random_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(_ids(rng, rng.randint(*input_len), vocab), rng.randint(*output_len))
        for _ in range(n)
    ]


def shared_prefix_workload(
    n: int, prefix_len: int, suffix_len: int, output_len: int, vocab: int, seed: int
) -> tuple[list[int], list[Request]]:
    """The shared prefix and the requests (each the prefix plus its own suffix)."""
    rng = random.Random(seed + 1)
    prefix = _ids(rng, prefix_len, vocab)
    return prefix, [Request(prefix + _ids(rng, suffix_len, vocab), output_len) for _ in range(n)]


# -- metrics (pure) --------------------------------------------------------------------------
def summarize(run: RunResult, reqs: list[Request]) -> dict[str, float | None]:
    n = len(reqs)
    out_tokens = sum(len(r.output_ids) for r in run.requests)
    in_tokens = sum(len(r.input_ids) for r in reqs)
    ttfts = [r.ttft_s for r in run.requests if r.ttft_s is not None]
    t = run.total_s
    return {
        "requests": n,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in run.requests),
        "total_s": t,
        "requests_per_s": n / t if t > 0 else 0.0,
        "output_tokens_per_s": out_tokens / t if t > 0 else 0.0,
        "total_tokens_per_s": (in_tokens + out_tokens) / t if t > 0 else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if len(ttfts) == n and n else None,
        "mean_latency_s": sum(r.latency_s for r in run.requests) / n if n else 0.0,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def agreement(a: RunResult, b: RunResult) -> int:
    """How many requests got the same output ids from both engines (greedy, same weights)."""
    return sum(x.output_ids == y.output_ids for x, y in zip(a.requests, b.requests, strict=True))


# -- actorlm -----------------------------------------------------------------------------------
async def _stream_all(engine: Any, reqs: list[Request]) -> tuple[float, list[RequestResult]]:
    t0 = time.perf_counter()

    async def one(req: Request) -> RequestResult:
        sampling = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
        ttft: float | None = None
        ids: list[int] = []
        cached = 0
        async for delta in engine.stream(req.input_ids, sampling):
            if delta.error:
                raise RuntimeError(f"request failed: {delta.error}")
            if delta.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(delta.token_ids)
            if delta.usage is not None:
                cached = delta.usage.cached_tokens
        return RequestResult(ttft, time.perf_counter() - t0, ids, cached)

    results = await asyncio.gather(*(one(r) for r in reqs))
    return time.perf_counter() - t0, list(results)


def run_actorlm(
    engine: Any, name: str, workload: str, reqs: list[Request], warmup: list[int]
) -> RunResult:
    engine.generate(warmup, {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    total, results = asyncio.run(_stream_all(engine, reqs))
    run = RunResult(name, workload, total, results)
    try:
        run.extra["stats"] = engine.stats()
    except Exception as exc:  # noqa: BLE001 - stats are a diagnostic only
        run.extra["stats_error"] = repr(exc)
    return run


def start_engine(path: Path, args: argparse.Namespace, prefix_cache: bool) -> Any:
    from actorlm import Engine

    options: dict[str, Any] = {"enable_prefix_cache": prefix_cache, "kv_cache_gb": args.kv_cache_gb}
    if args.max_running_requests:
        options["max_running_requests"] = args.max_running_requests
    if args.max_prefill_tokens:
        options["max_prefill_tokens"] = args.max_prefill_tokens
    if args.threads:
        options["num_threads"] = args.threads
    t0 = time.perf_counter()
    engine = Engine(str(path), **options)
    log(
        f"actorlm engine (prefix cache {'on' if prefix_cache else 'off'}) up in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return engine


# -- transformers ------------------------------------------------------------------------------
class HF:
    def __init__(self, path: Path, threads: int) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        from bench.forward import load_reference_model

        self.model = load_reference_model(path)
        gc = self.model.generation_config
        eos = gc.eos_token_id
        self.pad = (
            gc.pad_token_id
            if gc.pad_token_id is not None
            else (eos[0] if isinstance(eos, list) else (eos or 0))
        )
        log(f"transformers model loaded in {time.perf_counter() - t0:.1f}s")

    def run(self, workload: str, reqs: list[Request], batch_size: int) -> RunResult:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):  # type: ignore[misc]
            """generate() puts the prompt first, then each step's new tokens."""

            def __init__(self) -> None:
                self.calls = 0
                self.first: float | None = None

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        self._generate([reqs[0].input_ids[:16]], 2, None)  # warm-up
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        for start in range(0, len(reqs), batch_size):
            batch = reqs[start : start + batch_size]
            streamer = FirstToken()
            max_new = max(r.output_len for r in batch)
            with torch.inference_mode():
                out, width = self._generate([r.input_ids for r in batch], max_new, streamer)
            end = time.perf_counter() - t0
            ttft = streamer.first - t0 if streamer.first is not None else None
            for i, r in enumerate(batch):
                results.append(
                    RequestResult(ttft, end, out[i, width : width + r.output_len].tolist())
                )
        return RunResult("transformers", workload, time.perf_counter() - t0, results)

    def _generate(self, prompts: list[list[int]], max_new: int, streamer: Any) -> tuple[Any, int]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=self.pad,
            streamer=streamer,
        )
        return out, width


# -- report -------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(summary: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        f"Offline throughput, {Path(args.model_path).name}; targets: actorlm output tok/s "
        f">= {RANDOM_TARGET:g}x transformers static batching (batch {args.hf_batch_size}) on "
        f"`random`; mean TTFT >= {PREFIX_TARGET:g}x lower with the prefix cache on than off "
        "on `shared-prefix`.",
        "",
        "| workload | engine | requests | total s | req/s | output tok/s | total tok/s "
        "| mean TTFT s | output tok/s vs transformers | TTFT vs transformers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, engines in summary.items():
        ref = engines.get("transformers")
        for name, s in engines.items():
            tput = ratio(s["output_tokens_per_s"], ref["output_tokens_per_s"]) if ref else None
            ttft = ratio(ref["mean_ttft_s"], s["mean_ttft_s"]) if ref else None
            lines.append(
                f"| {workload} | {name} | {s['requests']} | {s['total_s']:.1f} "
                f"| {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} "
                f"| {s['total_tokens_per_s']:.1f} | {_f(s['mean_ttft_s'], '.2f')} "
                f"| {_f(tput, '.2f')}x | {_f(ttft, '.2f')}x |".replace("| -x", "| -")
            )
    lines.append("")
    rnd = summary.get("random", {})
    if "actorlm" in rnd and "transformers" in rnd:
        r = ratio(rnd["actorlm"]["output_tokens_per_s"], rnd["transformers"]["output_tokens_per_s"])
        met = "met" if r is not None and r >= RANDOM_TARGET else "NOT met"
        lines.append(
            f"- random: actorlm output tok/s = {_f(r, '.2f')}x transformers "
            f"(target >= {RANDOM_TARGET:g}x: {met})"
        )
    sp = summary.get("shared-prefix", {})
    on, off = sp.get("actorlm (cache on)"), sp.get("actorlm (cache off)")
    if on and off:
        r = ratio(off["mean_ttft_s"], on["mean_ttft_s"])
        met = "met" if r is not None and r >= PREFIX_TARGET else "NOT met"
        lines.append(
            f"- shared-prefix: mean TTFT cache off / cache on = {_f(r, '.2f')}x "
            f"(target >= {PREFIX_TARGET:g}x: {met}); cached prompt tokens "
            f"{on['cached_tokens']} of {on['input_tokens']} (on) vs {off['cached_tokens']} (off)"
        )
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="", help="GGUF file or HF folder (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: random,shared-prefix"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    g = p.add_argument_group("random workload")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--input-len", default="128:384", help="input length range LO:HI (tokens)")
    g.add_argument("--output-len", default="32:96", help="output length range LO:HI (tokens)")
    g = p.add_argument_group("shared-prefix workload")
    g.add_argument("--shared-num-requests", type=int, default=16)
    g.add_argument("--prefix-len", type=int, default=1024, help="shared system prompt tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="unique tokens per request")
    g.add_argument("--shared-output-len", type=int, default=32)
    g = p.add_argument_group("engines")
    g.add_argument("--hf-batch-size", type=int, default=8, help="transformers static batch size")
    g.add_argument("--skip-transformers", action="store_true", help="only actorlm")
    g.add_argument("--kv-cache-gb", type=float, default=2.0, help="actorlm KV pool budget")
    g.add_argument(
        "--max-running-requests", type=int, default=0, help="actorlm option (0: its default)"
    )
    g.add_argument(
        "--max-prefill-tokens", type=int, default=0, help="actorlm option (0: its default)"
    )
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: 8 random requests (32:64 in, 8:16 out), 4 shared-prefix "
        "requests (256 + 16 in, 8 out)",
    )
    p.add_argument("--out", default="bench/results/offline.json", help="raw results (JSON)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.input_len, args.output_len = 8, "32:64", "8:16"
        args.shared_num_requests, args.prefix_len = 4, 256
        args.suffix_len, args.shared_output_len = 16, 8
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workload_list:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from actorlm.gpu.default_model import default_model_path
    from actorlm.gpu.model_info import load_model_info

    path = Path(args.model) if args.model else default_model_path()
    args.model_path = str(path)
    vocab = load_model_info(path).vocab_size
    work: dict[str, list[Request]] = {}
    warmups: dict[str, list[int]] = {}
    if "random" in args.workload_list:
        work["random"] = random_workload(
            args.num_requests,
            parse_range(args.input_len),
            parse_range(args.output_len),
            vocab,
            args.seed,
        )
        warmups["random"] = _ids(random.Random(args.seed + 2), 16, vocab)
    if "shared-prefix" in args.workload_list:
        prefix, reqs = shared_prefix_workload(
            args.shared_num_requests,
            args.prefix_len,
            args.suffix_len,
            args.shared_output_len,
            vocab,
            args.seed,
        )
        work["shared-prefix"] = reqs
        warmups["shared-prefix"] = prefix + _ids(random.Random(args.seed + 3), 8, vocab)

    runs: list[RunResult] = []
    started = time.perf_counter()
    if not args.skip_transformers:
        hf = HF(path, args.threads)
        for name, reqs in work.items():
            runs.append(hf.run(name, reqs, args.hf_batch_size))
            log(f"transformers {name}: {runs[-1].total_s:.1f}s")
        del hf
    engine = start_engine(path, args, prefix_cache=True)
    try:
        for name, reqs in work.items():
            label = "actorlm (cache on)" if name == "shared-prefix" else "actorlm"
            engine.flush_cache()
            runs.append(run_actorlm(engine, label, name, reqs, warmups[name]))
            log(f"{label} {name}: {runs[-1].total_s:.1f}s")
    finally:
        engine.close()
    if "shared-prefix" in work:
        engine = start_engine(path, args, prefix_cache=False)
        try:
            runs.append(
                run_actorlm(
                    engine,
                    "actorlm (cache off)",
                    "shared-prefix",
                    work["shared-prefix"],
                    warmups["shared-prefix"],
                )
            )
            log(f"actorlm (cache off) shared-prefix: {runs[-1].total_s:.1f}s")
        finally:
            engine.close()

    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        summary.setdefault(run.workload, {})[run.engine] = summarize(run, work[run.workload])
    # transformers first in each workload's rows: it is the reference.
    summary = {
        w: dict(sorted(e.items(), key=lambda kv: kv[0] != "transformers"))
        for w, e in summary.items()
    }
    agree: dict[str, dict[str, int]] = {}
    for w in work:
        ref = next((r for r in runs if r.workload == w and r.engine == "transformers"), None)
        if ref is not None:
            agree[w] = {
                r.engine: agreement(r, ref)
                for r in runs
                if r.workload == w and r.engine != "transformers"
            }
    table = markdown(summary, args)
    if agree:
        table += "\n- same output ids as transformers (greedy): " + "; ".join(
            f"{w} {e} {n}/{len(work[w])}" for w, d in agree.items() for e, n in d.items()
        )
    print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model": str(path),
        "args": {k: v for k, v in vars(args).items() if k != "workload_list"},
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "agreement_with_transformers": agree,
        "runs": [asdict(r) for r in runs],
    }
    out.write_text(json.dumps(raw, indent=1, default=str))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
