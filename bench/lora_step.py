"""LoRA's cost per decode step, in one process: one ModelRunner with ``--adapters``
random adapters of rank ``--rank`` in its slots, a batch of ``--batch`` sequences
(request ``i`` uses adapter ``i mod k``), its prompts as one step with and without the
adapters (``base prefill``, ``lora prefill``, alternating), and each decode position
computed once by every path below in turn, so that all of them see the same load (a shared machine's
load drifts over seconds; engine-level runs, ``bench/lora.py``, compare runs seconds
apart). Reported: the median step time of each path over ``--steps`` positions, and
its throughput beside the base model's fused step (what users get without adapters).

Paths: ``base fused`` (the fused native step, no adapter), ``base model`` (the
model's torch forward, no adapter), ``lora fused`` (the fused step adding each row's
deltas), ``lora model native`` (the forward with the native LoRA kernel per
projection), ``lora model gather`` (the forward with torch's gather and batched
matmuls: the CPU path before the kernel).

    python bench/lora_step.py                 # the default model, batch 32, 8 adapters
    python bench/lora_step.py --batch 8 --steps 16

Writes ``--out`` (JSON; default ``bench/results/lora_step.json``) and the table beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/lora_step.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.config import ModelConfig  # noqa: E402
from actorlm.gpu.default_model import default_model_path  # noqa: E402
from actorlm.gpu.forward_meta import SeqSpec  # noqa: E402
from actorlm.gpu.lora.batch import BASE  # noqa: E402
from actorlm.gpu.lora.plan import LoraPlan  # noqa: E402
from actorlm.gpu.lora.targets import LORA_MODULES  # noqa: E402
from actorlm.gpu.runner import ModelRunner  # noqa: E402

from bench.gpu import machine  # noqa: E402
from bench.machine import save  # noqa: E402

PATHS = ("base fused", "base model", "lora fused", "lora model native", "lora model gather")
PREFILL_PATHS = ("base prefill", "lora prefill")  # the batch's prompts in one step


def load_adapters(runner: ModelRunner, k: int, rank: int, seed: int) -> None:
    pool = runner.lora
    assert pool is not None
    rng = np.random.default_rng(seed)
    L = pool.shapes.num_layers
    for slot in range(k):
        targets = []
        for m in LORA_MODULES:
            n_in, n_out = pool.shapes.modules[m]
            a = rng.standard_normal((L, rank, n_in), np.float32) / np.sqrt(n_in)
            b = rng.standard_normal((L, n_out, rank), np.float32) * 0.04  # scaling folded in
            targets.append((m, a, b))
        pool.load(slot, f"a{slot}", targets)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else default_model_path()
    opts: dict[str, Any] = {"fused_decode_max_batch": args.batch, "kv_cache_gb": 1.0}
    if args.threads:
        opts["num_threads"] = args.threads
    runner = ModelRunner(ModelConfig(path=str(model), **opts))
    runner.enable_lora(max(args.adapters, 1), args.rank)
    load_adapters(runner, args.adapters, args.rank, args.seed)
    pool, fused = runner.lora, runner.fused
    assert pool is not None and fused is not None
    B, ps = args.batch, runner.pool.page_size
    slots = sorted(i % args.adapters if args.adapters else BASE for i in range(B))
    rng = np.random.default_rng(args.seed)
    per_seq = -(-(args.input_len + args.steps + 1) // ps)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
    prompts = [rng.integers(100, 10000, args.input_len).tolist() for _ in range(B)]
    prefill_plan = LoraPlan.build([args.input_len] * B, slots, pool.ranks, native=pool.native)
    prompt_seqs = [SeqSpec(p, 0, pages[i]) for i, p in enumerate(prompts)]
    times: dict[str, list[float]] = {p: [] for p in (*PATHS, *PREFILL_PATHS)}
    for repeat in range(args.prefill_repeats + 1):  # the first warms up
        for path in PREFILL_PATHS:  # the same prompts into the same pages, each way
            pool.plan = prefill_plan if path.startswith("lora") else None
            t0 = time.perf_counter()
            try:
                logits = runner.run(prompt_seqs)
            finally:
                pool.plan = None
            if repeat:
                times[path].append(time.perf_counter() - t0)
    tokens = logits.argmax(1)  # the adapters' next tokens
    plans = {
        "native": LoraPlan.build([1] * B, slots, pool.ranks, native=True),
        "gather": LoraPlan.build([1] * B, slots, pool.ranks),
    }
    for step in range(args.steps + 2):  # the first two warm each path up
        pos = args.input_len + step
        seqs = [SeqSpec([int(t)], pos, pages[i]) for i, t in enumerate(tokens.tolist())]
        for path in PATHS:
            plan = (
                None
                if path.startswith("base")
                else plans["gather" if "gather" in path else "native"]
            )
            runner.fused = fused if "fused" in path else None
            pool.plan = plan
            t0 = time.perf_counter()
            try:
                logits = runner.run(seqs)
            finally:
                pool.plan, runner.fused = None, fused
            if step >= 2:
                times[path].append(time.perf_counter() - t0)
        tokens = logits.argmax(1)
    base = {
        p: statistics.median(times["base prefill" if p in PREFILL_PATHS else "base fused"])
        for p in times
    }
    rows = [
        {"path": p, "ms": 1e3 * statistics.median(t), "vs_base": base[p] / statistics.median(t)}
        for p, t in times.items()
    ]
    return {"rows": rows, "dtype": str(runner.dtype), "isa": fused.isa, "model": model.name}


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    m = res["machine"]
    lines = [
        f"LoRA per decode step, {res['model']} ({res['dtype']}, kernels {res['isa']}), batch "
        f"{args.batch}, {args.adapters} distinct adapters of rank {args.rank} on all seven "
        f"projections; median of {args.steps} positions, every path at each",
        f"CPU: {m.get('cpu_model', '?')} ({m.get('cores')} cores, load {m.get('load'):.1f}); "
        f"threads {args.threads or 'all'}; torch {m.get('torch')}; {res['date']}",
        "",
        "| path | ms / step | tok/s | vs base (fused decode; prefill) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        tokens = args.batch * (args.input_len if r["path"] in PREFILL_PATHS else 1)
        tok_s = tokens / r["ms"] * 1e3
        lines.append(f"| {r['path']} | {r['ms']:.1f} | {tok_s:.0f} | {r['vs_base']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="", help="GGUF file or HF folder (default: the embedded one)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters in the batch")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=24, help="decode positions timed")
    p.add_argument("--prefill-repeats", type=int, default=5, help="prompt steps timed each way")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/lora_step.json", help="raw results (JSON)")
    args = p.parse_args()
    res = run(args)
    res.update(
        command=" ".join(sys.argv),
        date=dt.datetime.now().isoformat(timespec="seconds"),
        machine={**machine(), "cores": os.cpu_count(), "load": os.getloadavg()[0]},
        args=vars(args),
    )
    save(res, markdown(res, args), args.out)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
