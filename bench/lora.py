"""LoRA throughput: output tokens/s of a batch of ``--batch`` requests using 0, 1, 4 and 8
distinct adapters of rank 8 and 64, beside the base model alone (an engine without
LoRA), on the same model and the same seeded prompts, in one run; and how long an
adapter takes to load (read and checked by the lora_loader; then into a worker slot).

Adapters are random, written in PEFT's format (``adapter_config.json`` and a bfloat16
``adapter_model.safetensors``: the files ``peft`` saves, which the tests read against
``peft`` itself), targeting ``--targets`` (all seven projections by default). Request
``i`` of a batch with ``k`` adapters uses adapter ``i mod k``; greedy, ``ignore_eos``.
Both engines (the base model alone, and with LoRA) run side by side; each configuration
is warmed up (its adapters are in slots before the clock starts), then timed
``--repeats`` times, each time right after a run of the base engine on the same
prompts, and the median ratio is reported (the machine's load drifts over minutes).

    python bench/lora.py                    # the default model (SmolLM2-135M Q4_1 GGUF)
    python bench/lora.py --quick            # a smoke run: batch 8, 8 output tokens

Writes ``--out`` (JSON; default ``bench/results/lora.json``) and the Markdown table
beside it (``.md``, also printed). Target: 8 distinct rank-8 adapters in a batch of 32
cost less than 20% of the base model's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/lora.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench.gpu import machine  # noqa: E402
from bench.machine import save  # noqa: E402

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_COST = 0.20  # 8 distinct rank-8 adapters may cost at most this share of base tok/s


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_adapter(folder: Path, model: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A random PEFT LoRA adapter for ``model`` (bfloat16, as adapters are often saved)."""
    import torch
    from actorlm.gpu.lora.targets import BaseShapes
    from actorlm.gpu.model_info import load_model_info
    from safetensors.torch import save_file

    shapes = BaseShapes.from_info(load_model_info(model))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for m in targets:
            k, n = shapes.modules[m]
            part = "self_attn" if m in ALL_TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            a = torch.randn(rank, k, generator=g) / math.sqrt(k)
            tensors[f"{key}.lora_A.weight"] = a.bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.02).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


async def _batch(engine: Any, prompts: list[list[int]], loras: list[str | None], n: int) -> Any:
    sampling = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.agenerate(p, sampling, lora=lora) for p, lora in zip(prompts, loras, strict=True))
    )
    return time.perf_counter() - t0, outs


_PER_RUN = ("tok_s", "wall_s", "steps", "forward_ms")  # kept for each timed run


def timed(
    engine: Any, prompts: list[list[int]], loras: list[str | None], args: argparse.Namespace
) -> dict[str, Any]:
    """One timed batch (``loras[i]`` for request ``i``), with the worker's steps and
    forward time over it (where the time went: more steps, or slower ones)."""
    before = engine.stats()["worker"]
    wall, outs = asyncio.run(_batch(engine, prompts, loras, args.output_len))
    after = engine.stats()["worker"]
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "steps": after["steps"] - before["steps"],
        "forward_ms": after["forward_ms_total"] - before["forward_ms_total"],
        "ids": [o.token_ids for o in outs],
    }


def start(model: Path, args: argparse.Namespace, **options: Any) -> Any:
    from actorlm import Engine

    t0 = time.perf_counter()
    if args.threads:
        options = {**options, "num_threads": args.threads}
    if args.fused_decode_max_batch >= 0:  # both engines: the base users get, and LoRA's
        options = {**options, "fused_decode_max_batch": args.fused_decode_max_batch}
    engine = Engine(
        str(model),
        kv_cache_gb=args.kv_cache_gb,
        log_level="warning",
        # a busy shared machine can starve a process for seconds: not a death
        peer_timeout_s=30.0,
        **options,
    )
    log(
        f"engine {'with LoRA ' if 'lora_paths' in options else ''}up in {time.perf_counter() - t0:.1f}s"
    )
    return engine


def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Both engines up at once; each configuration's runs alternate with the base
    engine's on the same prompts, so each ratio compares runs a few seconds apart (the
    machine's load drifts over minutes). Reported: the median over ``--repeats``."""
    from actorlm.gpu.model_info import load_model_info

    vocab = load_model_info(model).vocab_size
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(args.batch)
    ]
    root = Path(args.adapter_dir)
    adapters: dict[int, list[Path]] = {}
    for rank in args.rank_list:
        adapters[rank] = [
            write_adapter(root / f"r{rank}-{i}", model, rank, args.target_list, 1000 * rank + i)
            for i in range(max(args.adapter_counts))
        ]
    log(f"adapters written under {root}")
    configs: list[tuple[str, int, int, list[str | None]]] = [
        ("LoRA on, base requests", 0, 0, [None] * args.batch)
    ]
    for rank in args.rank_list:
        for k in (c for c in args.adapter_counts if c):
            loras: list[str | None] = [f"r{rank}-{i % k}" for i in range(args.batch)]
            configs.append((f"{k} adapter(s), rank {rank}", k, rank, loras))
    specs = [f"r{rank}-{i}={p}" for rank, paths in adapters.items() for i, p in enumerate(paths)]
    results: dict[str, Any] = {"runs": [], "loads": []}
    base_engine = start(model, args)
    engine = start(
        model,
        args,
        lora_paths=specs,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=max(args.rank_list),
    )
    try:
        asyncio.run(_batch(base_engine, prompts, [None] * args.batch, 2))  # warm-up
        base_all: list[float] = []
        for name, k, rank, loras in configs:
            asyncio.run(_batch(engine, prompts, loras, 2))  # warm-up: its adapters into slots
            pairs = []
            for _ in range(args.repeats):
                b = timed(base_engine, prompts, [None] * args.batch, args)
                r = timed(engine, prompts, loras, args)
                pairs.append((b, r))
            base_all += [b["tok_s"] for b, _ in pairs]
            row = {
                "config": name,
                "adapters": k,
                "rank": rank,
                "tok_s": statistics.median(r["tok_s"] for _, r in pairs),
                "base_tok_s": statistics.median(b["tok_s"] for b, _ in pairs),
                "vs_base": statistics.median(r["tok_s"] / b["tok_s"] for b, r in pairs),
                "runs": [
                    {key: {"base": b[key], "lora": r[key]} for key in _PER_RUN} for b, r in pairs
                ],
            }
            if k == 0:
                row["same_tokens_as_base"] = pairs[0][1]["ids"] == pairs[0][0]["ids"]
            results["runs"].append(row)
            log(f"{name}: {row['tok_s']:.1f} tok/s, {row['vs_base']:.2f} of base")
        results["base_tok_s"] = statistics.median(base_all)
        for rank in args.rank_list:
            results["loads"].append(load_times(engine, adapters[rank][0], rank, prompts[0]))
        results["lora_stats"] = engine.stats()["lora_loader"]
    finally:
        engine.close()
        base_engine.close()
    return results


def load_times(engine: Any, path: Path, rank: int, prompt: list[int]) -> dict[str, Any]:
    """Registering an adapter (read and checked, off the loader's loop), and the first
    request for it beside one for an adapter already in a slot (the slot load)."""
    one = {"max_new_tokens": 1, "temperature": 0.0}
    name = f"fresh-r{rank}"
    t0 = time.perf_counter()
    engine.load_lora_adapter(name, str(path))
    register_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.generate(prompt, one, lora=name)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.generate(prompt, one, lora=name)
    resident_ms = (time.perf_counter() - t0) * 1e3
    engine.unload_lora_adapter(name)
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    return {
        "rank": rank,
        "file_mib": size,
        "register_ms": register_ms,
        "first_request_ms": first_ms,
        "resident_request_ms": resident_ms,
        "slot_load_ms": first_ms - resident_ms,
    }


def markdown(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [
        f"LoRA throughput, {results['model']}, batch {args.batch} x ({args.input_len} in, "
        f"{args.output_len} out), greedy; targets {','.join(args.target_list)}; "
        f"{args.max_loras_per_batch} slots; median of {args.repeats} rounds, each against "
        "a base-alone run beside it",
        f"CPU: {m.get('cpu_model', '?')} ({m.get('cores')} cores, load {m.get('load')}); "
        f"worker threads {args.threads or 'all'}; fused decode up to batch "
        f"{'default' if args.fused_decode_max_batch < 0 else args.fused_decode_max_batch}; torch {m.get('torch')}; {results['date']}",
        "",
        "| configuration | distinct adapters | rank | output tok/s | base alone, same rounds "
        "| vs base alone |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| base model alone (no LoRA) | - | - | {results['base_tok_s']:.1f} | | 1.00 |",
    ]
    for r in results["runs"]:
        rank = r.get("rank") or "-"
        lines.append(
            f"| {r['config']} | {r['adapters']} | {rank} | {r['tok_s']:.1f} | "
            f"{r['base_tok_s']:.1f} | {r['vs_base']:.2f} |"
        )
    lines += [
        "",
        "| adapter rank | file MiB | register (read + check) ms | first request ms | "
        "with it in a slot ms | slot load ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in results["loads"]:
        lines.append(
            f"| {x['rank']} | {x['file_mib']:.1f} | {x['register_ms']:.0f} | "
            f"{x['first_request_ms']:.0f} | {x['resident_request_ms']:.0f} | "
            f"{x['slot_load_ms']:.0f} |"
        )
    eight = [r for r in results["runs"] if r["adapters"] == 8 and r.get("rank") == 8]
    if eight:
        cost = 1 - eight[0]["vs_base"]
        verdict = "met" if cost < TARGET_COST else "missed"
        lines += [
            "",
            f"8 distinct rank-8 adapters cost {cost:.1%} of the base model's throughput "
            f"(target < {TARGET_COST:.0%}: {verdict}).",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="", help="GGUF file or HF folder (default: the embedded one)")
    p.add_argument("--batch", type=int, default=32, help="requests per batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=48, help="output tokens per request")
    p.add_argument("--ranks", default="8,64", help="adapter ranks, comma-separated")
    p.add_argument("--adapters", default="0,1,4,8", help="distinct adapters per batch")
    p.add_argument("--targets", default=",".join(ALL_TARGETS), help="projections adapted")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in each worker (0: all cores; 1 keeps a shared machine's "
        "oversubscribed OpenMP barriers out of the numbers)",
    )
    p.add_argument(
        "--fused-decode-max-batch",
        type=int,
        default=-1,
        help="decode steps of up to this many sequences as one native call, in both "
        "engines (-1: the config's default; 0: off)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--adapter-dir", default="bench/results/lora-adapters", help="where adapters are written"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: batch 8, 8 output tokens")
    p.add_argument("--out", default="bench/results/lora.json", help="raw results (JSON)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.output_len, args.repeats, args.ranks = 8, 8, 1, "8"
    args.rank_list = [int(r) for r in args.ranks.split(",") if r]
    args.adapter_counts = [int(k) for k in args.adapters.split(",") if k]
    args.target_list = [t for t in args.targets.split(",") if t]
    unknown = set(args.target_list) - set(ALL_TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; known: {', '.join(ALL_TARGETS)}")
    if max(args.adapter_counts) > args.max_loras_per_batch:
        p.error("--adapters asks for more distinct adapters than --max-loras-per-batch")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from actorlm.gpu.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    results = run(args, model)
    results.update(
        model=model.name,
        command=" ".join(sys.argv),
        date=dt.datetime.now().isoformat(timespec="seconds"),
        machine={**machine(), "cores": os.cpu_count(), "load": os.getloadavg()[0]},
        args={k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)},
    )
    save(results, markdown(results, args), args.out)


if __name__ == "__main__":
    main()
