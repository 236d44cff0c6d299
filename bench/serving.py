"""Serving benchmark: actorlm beside its peers, on the same model and seeded workload, in one run.

Each engine in ``--engines`` is started on the same model (actorlm and llama.cpp on
the GGUF, vLLM, ``transformers serve`` and ``actorlm-hf`` on its fp32 safetensors
copy), warmed up with one request, driven through every load level with the same
requests, and stopped before the next starts. A missing peer is reported and skipped.

    python bench/serving.py --engines actorlm,vllm,llamacpp,transformers \\
        --dataset random --concurrency 1,8,32
    python bench/serving.py --url http://127.0.0.1:8000 --dataset chat --request-rate 1,2

Writes ``--out`` (JSON; default ``bench/results/serving-<dataset>.json``), the
Markdown table beside it (``.md``, also printed) and ``-throughput.png`` and
``-latency.png`` plots. See bench/README.md for what each column means. A second table
puts every engine against the machine's ceiling for each level (bench/serving_bound.py:
the least time the level's work can take here, from the read bandwidth and GEMM
throughput measured before the engines start; ``--no-ceiling`` skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/serving.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench import machine, peers  # noqa: E402
from bench.processes import EngineProcess, free_port  # noqa: E402
from bench.serving_bound import ModelCost, level_floor, measure_limits  # noqa: E402
from bench.serving_client import run_level, send_one, server_info, wait_ready  # noqa: E402
from bench.serving_metrics import count_output_tokens, summarize  # noqa: E402
from bench.serving_report import ceiling_table, markdown_table, plot_results  # noqa: E402
from bench.workloads import (  # noqa: E402
    DATASETS,
    BenchRequest,
    Workload,
    WorkloadParams,
    build_workload,
    load_tokenizer,
    parse_range,
)

__all__ = [
    "EngineProcess",
    "TimeBudget",
    "auto_num_prompts",
    "level_workloads",
    "main",
    "parse_args",
]

MIN_LEVEL_S = 60.0  # a level always gets this long, whatever the budget says


class TimeBudget:
    """Spreads ``--time-budget`` over the load levels still to run, so a whole run ends in
    time however slow an engine is: each level may use ``cap`` seconds and at most an
    equal share of what is left (never under ``MIN_LEVEL_S``). Levels that end early and
    engines that are skipped or fail leave more for the rest; start-ups are paid from the total."""

    def __init__(
        self, total_s: float, levels: int, cap_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self.deadline = clock() + total_s if total_s > 0 else None
        self.levels_left = levels
        self.cap_s = cap_s

    def next_level(self) -> float:
        """The time limit of the next level (which it then counts as run)."""
        limit = self.cap_s
        if self.deadline is not None:
            share = (self.deadline - self._clock()) / max(1, self.levels_left)
            limit = min(limit, max(MIN_LEVEL_S, share))
        self.levels_left = max(0, self.levels_left - 1)
        return limit


def auto_num_prompts(concurrency: int | None, rate: float | None) -> int:
    """Enough requests for a few waves at ``concurrency``, bounded for a 2-core machine."""
    if concurrency:
        return min(96, max(12, 3 * concurrency))
    return min(96, max(16, int(30 * (rate or 1))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("engines")
    g.add_argument(
        "--engines",
        default="actorlm",
        help=f"comma list from {','.join(peers.ENGINES)} (default actorlm)",
    )
    g.add_argument(
        "--url",
        default=None,
        help="benchmark this already running server instead of starting engines",
    )
    g.add_argument("--served-model", default=None, help="model name to send (default: /v1/models)")
    g.add_argument(
        "--model", type=Path, default=None, help="GGUF (default: actorlm's default model)"
    )
    g.add_argument(
        "--hf-dir",
        type=Path,
        default=None,
        help="fp32 safetensors folder for vLLM/transformers (default: dequantized "
        "once under ~/.cache/actorlm-bench/hf)",
    )
    g.add_argument(
        "--venv-dir",
        type=Path,
        default=None,
        help="peers' venvs folder (default $ACTORLM_BENCH_VENVS or ~/.cache/actorlm-bench/venvs)",
    )
    g.add_argument("--setup-peers", action="store_true", help="create missing peers' venvs first")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=18300, help="first port to try")
    g.add_argument("--startup-timeout", type=float, default=None, help="override each engine's")
    g.add_argument("--actorlm-args", default="", help="extra arguments for `actorlm serve`")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="cores every engine gets, the same for all (default: all this process may use)",
    )
    g.add_argument(
        "--peer-dtypes",
        default="best,float32",
        help="dtypes each peer runs in, one run each (best: bf16 where the CPU has native "
        "bf16, else fp32; llama.cpp runs the GGUF's own blocks once)",
    )
    g.add_argument(
        "--actorlm-dtypes", default="auto", help="dtypes actorlm runs in (auto: its own choice)"
    )
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random")
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per level (default: 3×concurrency within 12..96)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", default="200:300", help="random: prompt tokens, N or MIN:MAX")
    w.add_argument("--output-len", default="64", help="output tokens, N or MIN:MAX")
    w.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    w.add_argument(
        "--system-len", type=int, default=1024, help="shared-prefix: shared prompt tokens"
    )
    w.add_argument("--question-len", default="32:64", help="shared-prefix: own question tokens")
    w.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    w.add_argument("--user-len", default="48:80", help="chat: user message tokens per turn")
    w.add_argument(
        "--no-ignore-eos", action="store_true", help="do not ask engines to run to max_tokens"
    )
    w.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's (0: greedy; OpenAI's default is 1)",
    )
    w.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    w.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="every request's logprobs (the completions API's: the N best tokens a position)",
    )
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default="1,8,32", help="comma list of levels")
    load.add_argument(
        "--request-rate",
        default=None,
        help="comma list of Poisson rates (req/s); levels become rates, with "
        "--concurrency's first value as a cap unless --max-concurrency 0",
    )
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument(
        "--time-limit", type=float, default=600.0, help="at most this many seconds per level"
    )
    load.add_argument(
        "--time-budget",
        type=float,
        default=27 * 60.0,
        help="seconds for the whole run, engine start-ups included, shared among the levels "
        "still to run (0: no budget, --time-limit alone)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None)
    o.add_argument("--no-plots", action="store_true")
    o.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip measuring the machine's limits and each level's ceiling (bench/serving_bound.py)",
    )
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--keep-text", action="store_true", help="keep output texts in the JSON")
    return p.parse_args(argv)


def _levels(args: argparse.Namespace) -> list[tuple[int | None, float | None]]:
    concs = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.request_rate:
        cap = args.max_concurrency if args.max_concurrency is not None else None
        return [(cap or None, float(r)) for r in args.request_rate.split(",") if r.strip()]
    return [(c, None) for c in concs]


def level_workloads(
    tok: Any, args: argparse.Namespace, levels: list[tuple[int | None, float | None]]
) -> list[Workload]:
    """One workload a level, the same for every engine. Level i draws its own requests
    (seed ``--seed`` + i): a level that repeated an earlier one's prompts (as the first
    12 of 24 random prompts would, drawn from one seed) would be served from every
    engine's prefix cache."""
    out = []
    for i, (conc, rate) in enumerate(levels):
        params = WorkloadParams(
            dataset=args.dataset,
            num_prompts=args.num_prompts or auto_num_prompts(conc, rate),
            seed=args.seed + i,
            input_len=parse_range(args.input_len),
            output_len=parse_range(args.output_len),
            num_groups=args.num_groups,
            system_len=args.system_len,
            question_len=parse_range(args.question_len),
            turns=args.turns,
            user_len=parse_range(args.user_len),
        )
        out.append(build_workload(tok, params))
    return out


async def _bench_engine(
    url: str,
    model_id: str | None,
    extra: Any,
    args: argparse.Namespace,
    workloads: list[Workload],
    levels: list[tuple[int | None, float | None]],
    encode: Any,
    label: str,
    budget: TimeBudget,
) -> list[dict[str, Any]]:
    import aiohttp

    # Warm-up: one short request, not measured (first-call compilation, caches). A server
    # that is up but still loading answers 503: ask again until it is ready.
    deadline = time.monotonic() + 600
    async with aiohttp.ClientSession() as session:
        while True:
            warm = await send_one(
                session, url, model_id, BenchRequest("Hello, my name is", 5, 8), extra, timeout=300
            )
            if warm.ok or not warm.error.startswith("HTTP 503") or time.monotonic() > deadline:
                break
            await asyncio.sleep(2.0)
    if not warm.ok:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    out: list[dict[str, Any]] = []
    for (conc, rate), wl in zip(levels, workloads, strict=True):
        desc = f"{label} " + (f"rate={rate:g}" if rate else f"c={conc}")
        limit = budget.next_level()
        run = await run_level(
            url,
            model_id,
            wl,
            extra,
            concurrency=conc,
            request_rate=rate,
            seed=args.seed,
            time_limit=limit,
            progress=not args.no_progress,
            desc=desc,
        )
        count_output_tokens(run.results, encode)
        ok = [r for r in run.results if r.ok]
        summary = summarize(run.results, None if ok else run.duration)
        out.append(
            {
                "concurrency": conc,
                "request_rate": rate,
                "num_prompts": wl.params.num_prompts,
                "time_limit_s": round(limit, 1),
                "timed_out": run.timed_out,
                "summary": summary,
                "requests": [r.to_json(args.keep_text) for r in run.results],
            }
        )
        s = summary
        print(
            f"  {desc}: {s['completed']} ok, {s['failed']} failed, "
            f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
            f"ITL p50 {s['itl_ms']['p50']:.1f} ms",
            flush=True,
        )
    return out


def ceilings(
    gguf: Path,
    limits: dict[str, float],
    workloads: list[Workload],
    levels: list[tuple[int | None, float | None]],
    encode: Callable[[str], list[int]],
) -> list[dict[str, Any]]:
    """Each level's floor on this machine (bench/serving_bound.py), from the requests
    every engine was sent."""
    cost = ModelCost.from_gguf(gguf)
    out = []
    for (conc, rate), wl in zip(levels, workloads, strict=True):
        reqs = wl.requests
        floor = level_floor(
            cost,
            limits["read_bandwidth"],
            limits["gemm"],
            [encode(r.prompt) for r in reqs],
            [r.output_tokens for r in reqs],
            conc,
        )
        out.append({"concurrency": conc, "request_rate": rate, **floor})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or REPO / "bench" / "results" / f"serving-{args.dataset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf = (args.model or peers.default_gguf()).resolve()
    names = ["external"] if args.url else [e.strip() for e in args.engines.split(",") if e.strip()]
    table = peers.engines(args.venv_dir)
    for n in names:
        if n != "external" and n not in table:
            raise SystemExit(f"unknown engine {n!r}; known: {', '.join(table)}")
    cpus = machine.cores()[: args.threads or None]
    specs = peers.plan_runs(
        [n for n in names if n != "external"],
        table,
        [d.strip() for d in args.peer_dtypes.split(",") if d.strip()],
        [d.strip() for d in args.actorlm_dtypes.split(",") if d.strip()],
        cpus,
        machine.best_dtype(),
    )

    if args.setup_peers:
        for spec in specs:
            if (
                spec.venv is not None
                and spec.name in peers.PEER_PACKAGES
                and spec.missing(peers.ModelFiles(gguf, None)) is not None
            ):
                print(f"setting up {spec.label} in {spec.venv} ...", flush=True)
                try:
                    peers.setup_peer(spec.name, args.venv_dir)
                except subprocess.CalledProcessError as e:
                    print(f"  set-up of {spec.label} failed: {e}", flush=True)
    hf_dir = args.hf_dir or peers.default_hf_dir(gguf)
    if any(s.needs_hf_dir for s in specs) and not (hf_dir / "config.json").exists():
        print(f"dequantizing {gguf.name} to {hf_dir} (once) ...", flush=True)
        peers.ensure_hf_dir(gguf, hf_dir)

    tok = load_tokenizer(hf_dir, gguf)
    files = peers.ModelFiles(
        gguf, hf_dir if (hf_dir / "config.json").exists() else None, eos_token_id=tok.eos_token_id
    )

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    levels = _levels(args)
    workloads = level_workloads(tok, args, levels)
    first = workloads[0]
    print(f"workload {args.dataset}: {first.describe()}", flush=True)

    data: dict[str, Any] = {
        "dataset": args.dataset,
        "model": gguf.name,
        "gguf": str(gguf),
        "hf_dir": str(files.hf_dir) if files.hf_dir else None,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**machine.describe(with_torch=False), "threads": len(cpus)},
        "cpu_pressure_before": machine.cpu_pressure(),
        "command": " ".join(
            [
                Path(sys.argv[0]).name if argv is None else "serving.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "workloads": [w.describe() for w in workloads],  # one a level, in order
        "engines": {},
    }

    # the machine's limits, measured before any engine starts; an external server's model
    # is the GGUF only where --model names it (the ceiling is priced from a GGUF's blocks:
    # a model folder gets none)
    if not args.no_ceiling and (args.model or not args.url) and gguf.is_file():
        data["limits"] = measure_limits()

    def save() -> None:
        out.write_text(json.dumps(data, indent=1, default=str))

    running: list[EngineProcess] = []

    def _on_signal(signum: int, _frame: Any) -> None:
        for p in running:
            p.stop(grace=5)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    logs = out.with_suffix("").with_name(out.stem + "-logs")
    runs = len(specs) + (1 if args.url else 0)
    budget = TimeBudget(args.time_budget, runs * len(levels), args.time_limit)

    if args.url:
        extra = (lambda n: {}) if args.no_ignore_eos else (lambda n: {"ignore_eos": True})
        model_id = args.served_model or asyncio.run(
            wait_ready(args.url, ("/health", "/v1/models"), 30)
        )
        entry: dict[str, Any] = {"label": args.url, "note": "", "levels": []}
        data["engines"]["external"] = entry
        entry["levels"] = asyncio.run(
            _bench_engine(
                args.url, model_id, extra, args, workloads, levels, encode, "external", budget
            )
        )
        save()

    for spec in specs:
        left_after = budget.levels_left - len(levels)  # however this engine's run ends
        entry = {"label": spec.label, "note": spec.describe(files), "levels": []}
        data["engines"][spec.name] = entry
        why = spec.missing(files)
        if why:
            print(f"SKIP {why}", flush=True)
            entry["skipped"] = why
            budget.levels_left -= len(levels)
            save()
            continue
        port = free_port(args.host, args.port)
        argv_ = spec.argv(spec, files, args.host, port)
        if spec.name.startswith("actorlm") and args.actorlm_args:
            argv_ += args.actorlm_args.split()
        url = f"http://{args.host}:{port}"
        env = spec.run_env()
        proc = EngineProcess(argv_, env, logs / f"{spec.name}.log")
        running.append(proc)
        entry["command"] = " ".join(argv_)
        entry["env"] = {k: os.environ.get(k, v) for k, v in env.items()}
        entry["dtype"], entry["threads"] = spec.dtype, len(spec.threads)
        entry["log"] = str(proc.log)
        print(f"starting {spec.label}: {entry['command']}", flush=True)
        t0 = time.perf_counter()
        try:
            timeout = args.startup_timeout or spec.startup_timeout
            model_id = args.served_model or asyncio.run(
                wait_ready(url, spec.health_paths, timeout, proc.alive)
            )
            entry["startup_s"] = round(time.perf_counter() - t0, 1)
            entry["model_id"] = model_id
            print(f"  ready in {entry['startup_s']} s (model id {model_id!r})", flush=True)

            def extra(n: int, spec: peers.EngineSpec = spec) -> dict[str, Any]:
                sampling = {"temperature": args.temperature}
                if args.top_p < 1:
                    sampling["top_p"] = args.top_p
                if args.logprobs is not None:
                    sampling["logprobs"] = args.logprobs
                return sampling | ({} if args.no_ignore_eos else spec.extra_body(n, files))

            if spec.name.startswith("actorlm"):  # what it chose: dtype, kernels' ISA
                entry["server_info"] = asyncio.run(server_info(url))
            entry["levels"] = asyncio.run(
                _bench_engine(
                    url, model_id, extra, args, workloads, levels, encode, spec.label, budget
                )
            )
            entry["cpu_pressure_after"] = machine.cpu_pressure()
        except Exception as e:  # noqa: BLE001 - one engine's failure must not stop the others
            entry["skipped"] = f"{type(e).__name__}: {e}"
            print(
                f"FAILED {spec.label}: {entry['skipped']}\n--- log tail ---\n{proc.tail()}",
                flush=True,
            )
        finally:
            proc.stop()
            running.remove(proc)
            budget.levels_left = left_after
        save()

    if data.get("limits"):
        data["ceiling"] = ceilings(gguf, data["limits"], workloads, levels, encode)
    save()
    table_md = markdown_table(data)
    if data.get("ceiling"):
        table_md += "\n\n" + ceiling_table(data)
    header = (
        f"Serving benchmark, dataset `{args.dataset}`, model `{gguf.name}`, "
        f"{data['date']}, {data['machine']['cpu']} ({data['machine']['threads']} cores to "
        f"every engine; {' '.join(data['machine']['isa_flags'])})\n\n"
    )
    md_path = out.with_suffix(".md")
    md_path.write_text(header + table_md + "\n")
    print("\n" + header + table_md)
    if not args.no_plots:
        try:
            for p in plot_results(data, out.with_suffix("")):
                print(f"wrote {p}")
        except ImportError:
            print("matplotlib is not installed: no plots (pip install matplotlib)")
    print(f"wrote {out} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
