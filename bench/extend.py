"""New tokens over a cached prefix: the step a follow-up turn, a retried prompt (its
last partial page) or a short prompt costs, through the fused native step and through
the model's forward, in one run.

One sequence of ``--context-len`` tokens is prefilled; then each of ``--news`` new-token
counts runs as a fresh request over those cached pages (ModelRunner, no actors),
``--repeats`` times, median kept, the two runners alternating so load drift hits both.
``--decodes N`` puts N other sequences (``--decode-context`` cached tokens each) in
every step, a token each, as a serving step carries a prompt chunk beside decodes.

    python bench/extend.py                                  # 1 4 8 16 32 over 1,104
    python bench/extend.py --context-len 256 --news 4,16 --dtype float32
    python bench/extend.py --context-len 16 --news 250 --decodes 8   # a mixed step
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/extend.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.config import ModelConfig  # noqa: E402
from actorlm.gpu.loaders.base import model_path  # noqa: E402
from actorlm.messages.step import SeqInit, SeqStep  # noqa: E402

from bench import machine  # noqa: E402
from bench.forward import GREEDY, Ours, prompt_ids  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="", help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--context-len", type=int, default=1104, help="cached tokens")
    p.add_argument("--news", default="1,4,8,16,32", help="new-token counts, comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--decodes", type=int, default=0, help="decoding sequences beside, a row each")
    p.add_argument("--decode-context", type=int, default=300, help="their cached tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", default="bench/results/extend.json", help="raw results (JSON)")
    return p.parse_args()


def num_pages(args: argparse.Namespace) -> int:
    return prefix_pages(args) + args.decodes * decode_pages(args) + 1


def prefix_pages(args: argparse.Namespace) -> int:
    return -(-(args.context_len + max(int(n) for n in args.news.split(","))) // 16)


def decode_pages(args: argparse.Namespace) -> int:
    return -(-(args.decode_context + 1) // 16)


def runner_of(args: argparse.Namespace, path: str, fused: bool) -> Ours:
    opts = argparse.Namespace(
        fused_decode_max_batch=-1 if fused else 0, threads=args.threads, attention_backend=""
    )
    return Ours(path, opts, num_pages(args), args.dtype, args.quantization, "native")


def main() -> None:
    args = parse_args()
    path = str(model_path(ModelConfig(path=args.model)))
    engines = {"fused step": runner_of(args, path, True), "model": runner_of(args, path, False)}
    vocab = next(iter(engines.values())).runner.info.vocab_size
    prefix = prompt_ids(args.context_len, 0, vocab)
    pages = list(range(prefix_pages(args)))
    decodes: list[tuple[str, list[int]]] = []  # each decoding sequence's id and pages
    for i in range(args.decodes):
        first = prefix_pages(args) + i * decode_pages(args)
        decodes.append((f"d{i}", list(range(first, first + decode_pages(args)))))
    for e in engines.values():  # the cached prefix, in each runner's own pool
        init = SeqInit(sampling=GREEDY, token_ids=prefix, prompt_len=len(prefix))
        e._forward([SeqStep("prefix", prefix, 0, pages, True, init)])
        for i, (rid, table) in enumerate(decodes):
            own = prompt_ids(args.decode_context, 1000 + i, vocab)
            init = SeqInit(sampling=GREEDY, token_ids=own, prompt_len=len(own))
            e._forward([SeqStep(rid, own, 0, table, True, init)])
    beside = [SeqStep(rid, [7], args.decode_context, table) for rid, table in decodes]
    ms: dict[str, dict[int, list[float]]] = {name: {} for name in engines}
    for n in (int(x) for x in args.news.split(",")):
        new = prompt_ids(n, n, vocab)
        ids = prefix + new
        for r in range(args.repeats + 1):
            for name, e in engines.items():
                init = SeqInit(sampling=GREEDY, token_ids=ids, prompt_len=len(ids))
                step = SeqStep(f"x{n}.{r}", new, args.context_len, pages, True, init)
                t0 = time.perf_counter()
                e._forward([*beside, step])
                dt = time.perf_counter() - t0
                e._forward([], release=[step.rid])
                if r:  # the first is a warm-up
                    ms[name].setdefault(n, []).append(dt * 1e3)
    m = machine.describe()
    print(f"{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}")
    over = f"over {args.context_len}" + (f", {args.decodes} decodes beside" if decodes else "")
    print(f"\n| new tokens {over} | " + " | ".join(f"{k} ms" for k in engines) + " |")
    print("| ---: |" + " ---: |" * len(engines))
    table: dict[str, Any] = {name: {} for name in engines}
    for n in ms["model"]:
        cells = []
        for name in engines:
            table[name][n] = statistics.median(ms[name][n])
            cells.append(f"{table[name][n]:.2f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "args": vars(args), "ms": ms, "median_ms": table}))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
