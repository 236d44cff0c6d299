"""LoRA throughput: output tokens/s of a batch of ``--batch`` requests using 0, 1, 4 and 8
distinct adapters of rank 8 and 64, beside the base model alone (an engine without
LoRA), on the same model and the same seeded prompts, in one run; and how long an
adapter takes to load (read and checked by the lora_loader; then into a worker slot).

Adapters are random, written in PEFT's format (``adapter_config.json`` and a bfloat16
``adapter_model.safetensors``: the files ``peft`` saves, which the tests read against
``peft`` itself), targeting ``--targets`` (all seven projections by default). Request
``i`` of a batch with ``k`` adapters uses adapter ``i mod k``; greedy, ``ignore_eos``.
Each configuration is warmed up (its adapters are in slots before the clock starts)
and timed ``--repeats`` times; the best run is reported.

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
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/lora.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench.gpu import machine  # noqa: E402

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


def timed(
    engine: Any, prompts: list[list[int]], loras: list[str | None], args: argparse.Namespace
) -> dict[str, Any]:
    asyncio.run(_batch(engine, prompts, loras, 2))  # warm-up: every adapter into its slot
    best: dict[str, Any] | None = None
    for _ in range(args.repeats):
        wall, outs = asyncio.run(_batch(engine, prompts, loras, args.output_len))
        tokens = sum(len(o.token_ids) for o in outs)
        run = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}
        if best is None or run["tok_s"] > best["tok_s"]:
            best = {**run, "token_ids": [o.token_ids for o in outs]}
    assert best is not None
    return best


def start(model: Path, args: argparse.Namespace, **options: Any) -> Any:
    from actorlm import Engine

    t0 = time.perf_counter()
    engine = Engine(str(model), kv_cache_gb=args.kv_cache_gb, log_level="warning", **options)
    log(f"engine {'with LoRA ' if options else ''}up in {time.perf_counter() - t0:.1f}s")
    return engine


def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
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
    results: dict[str, Any] = {"runs": [], "loads": []}
    with start(model, args) as base:
        base_run = timed(base, prompts, [None] * args.batch, args)
    results["runs"].append({"config": "base model alone", "adapters": 0, "rank": 0, **base_run})
    log(f"base alone: {base_run['tok_s']:.1f} tok/s")
    specs = [f"r{rank}-{i}={p}" for rank, paths in adapters.items() for i, p in enumerate(paths)]
    with start(
        model,
        args,
        lora_paths=specs,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=max(args.rank_list),
    ) as engine:
        lora0 = timed(engine, prompts, [None] * args.batch, args)
        lora0["agrees_with_base"] = lora0["token_ids"] == base_run["token_ids"]
        results["runs"].append({"config": "LoRA on, base requests", "adapters": 0, **lora0})
        for rank in args.rank_list:
            for k in (c for c in args.adapter_counts if c):
                loras = [f"r{rank}-{i % k}" for i in range(args.batch)]
                r = timed(engine, prompts, loras, args)
                results["runs"].append(
                    {"config": f"{k} adapter(s), rank {rank}", "adapters": k, "rank": rank, **r}
                )
                log(f"{k} adapters of rank {rank}: {r['tok_s']:.1f} tok/s")
        for rank in args.rank_list:
            results["loads"].append(load_times(engine, adapters[rank][0], rank, prompts[0]))
        results["lora_stats"] = engine.stats()["lora_loader"]
    for r in results["runs"]:
        r["vs_base"] = r["tok_s"] / base_run["tok_s"]
        r.pop("token_ids", None)
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
        f"{args.max_loras_per_batch} slots; best of {args.repeats}",
        f"CPU: {m.get('cpu_model', '?')}; torch {m.get('torch')}; {results['date']}",
        "",
        "| configuration | distinct adapters | rank | output tok/s | vs base alone |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results["runs"]:
        rank = r.get("rank") or "-"
        lines.append(
            f"| {r['config']} | {r['adapters']} | {rank} | {r['tok_s']:.1f} | {r['vs_base']:.2f} |"
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
    p.add_argument("--repeats", type=int, default=2, help="timed runs per configuration")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
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
        machine=machine(),
        args={k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)},
    )
    table = markdown(results, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
