"""Decodes over a shared system prompt: the fused step's cascade attention (the shared
pages read once for a chunk of rows, kernels/step.py's ``Cascade``) against attending
row by row, in one run; with ``--fused-decode-max-batch 0`` the cpu attention backend's
decodes (the model's forward: batches past the fused step's, families it does not take).

A prompt of ``--shared-len`` tokens is prefilled once (one a group: ``--groups``, the
sequences dealt to them in turn); each of B sequences then adds ``--tail-len`` tokens
of its own over those pages (as the prefix cache hands them out)
and decodes; each batch size runs ``--steps`` decode steps with the cascade and as many
without, alternating in ``--repeats`` rounds (best round kept) so load drift hits both.

    python bench/cascade.py                                   # B 4 16 32 over 1,024
    python bench/cascade.py --batch-sizes 8 --shared-len 4096 --quantization gguf_a8
    python bench/cascade.py --fused-decode-max-batch 0        # through the backend
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/cascade.py` from anywhere
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
    p.add_argument("--batch-sizes", default="4,16,32", help="sequences, comma-separated")
    p.add_argument("--shared-len", type=int, default=1024, help="the shared prompt's tokens")
    p.add_argument("--tail-len", type=int, default=40, help="each sequence's own prompt tokens")
    p.add_argument("--groups", type=int, default=1, help="shared prompts, sequences dealt out")
    p.add_argument("--steps", type=int, default=24, help="decode steps a round and mode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument(
        "--fused-decode-max-batch", type=int, default=-1, help="0: decodes through the backend"
    )
    p.add_argument("--out", default="bench/results/cascade.json", help="raw results (JSON)")
    return p.parse_args()


def measure(engine: Ours, b: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """ms a step with the cascade on and off, for ``b`` sequences over the shared pages."""
    runner = engine.runner
    ps, vocab = runner.info.page_size, runner.info.vocab_size
    per = -(-args.shared_len // ps)
    heads, prompts = [], []
    for g in range(args.groups):
        shared = prompt_ids(args.shared_len, 1000 + g, vocab)
        head = list(range(g * per, (g + 1) * per))
        init = SeqInit(sampling=GREEDY, token_ids=shared, prompt_len=len(shared))
        engine._forward([SeqStep(f"shared{g}", shared, 0, head, True, init)])
        heads.append(head)
        prompts.append(shared)
    steps = 2 * (args.repeats + 1) * args.steps + 1
    own = -(-(args.tail_len + steps) // ps)
    base = args.groups * per
    rids, tables, tokens = [f"s{i}" for i in range(b)], [], []
    for i, rid in enumerate(rids):
        head, shared = heads[i % args.groups], prompts[i % args.groups]
        table = head + list(range(base + i * own, base + (i + 1) * own))
        ids = shared + prompt_ids(args.tail_len, 1 + i, vocab)
        init = SeqInit(sampling=GREEDY, token_ids=ids, prompt_len=len(ids))
        tokens += engine._forward(
            [SeqStep(rid, ids[len(shared) :], len(shared), table, True, init)]
        )
        tables.append(table)
    pos = len(shared) + args.tail_len
    ms: dict[str, list[float]] = {"cascade": [], "row by row": []}
    for r in range(args.repeats + 1):
        for mode in ms:
            switch(engine, mode == "cascade")
            t0 = time.perf_counter()
            for _ in range(args.steps):
                seqs = [
                    SeqStep(i, [t], pos, tb) for i, t, tb in zip(rids, tokens, tables, strict=True)
                ]
                tokens = engine._forward(seqs)
                pos += 1
            if r:  # the first round warms up
                ms[mode].append((time.perf_counter() - t0) / args.steps * 1e3)
    engine._forward([], release=[*(f"shared{g}" for g in range(args.groups)), *rids])
    switch(engine, True)
    return ms


def switch(engine: Ours, on: bool) -> None:
    """The cascade on or off wherever decodes attend: the fused step and the backend."""
    engine.runner.backend.cascade = on  # type: ignore[attr-defined]
    if engine.runner.fused is not None:
        engine.runner.fused.cascade = on


def main() -> None:
    args = parse_args()
    path = str(model_path(ModelConfig(path=args.model)))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    steps = 2 * (args.repeats + 1) * args.steps + 1
    pages = args.groups * -(-args.shared_len // 16) + max(sizes) * -(-(args.tail_len + steps) // 16)
    pages += 1
    opts = argparse.Namespace(
        fused_decode_max_batch=args.fused_decode_max_batch,
        threads=args.threads,
        attention_backend="",
    )
    engine = Ours(path, opts, pages, args.dtype, args.quantization, "auto")
    runs = {b: measure(engine, b, args) for b in sizes}
    m = machine.describe()
    print(f"{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}")
    print(
        f"{args.dtype} {args.quantization}, "
        f"{'fused step' if engine.runner.fused else 'the backend'}: decodes over "
        f"{args.groups} shared {args.shared_len}-token "
        f"prompt(s) and {args.tail_len} tokens each; ms a step, best of {args.repeats}\n"
    )
    print("| sequences | cascade | row by row | speed-up |")
    print("| ---: | ---: | ---: | ---: |")
    best: dict[int, dict[str, float]] = {}
    for b, ms in runs.items():
        best[b] = {mode: min(v) for mode, v in ms.items()}
        on, off = best[b]["cascade"], best[b]["row by row"]
        print(f"| {b} | {on:.2f} | {off:.2f} | {off / on:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"machine": m, "args": vars(args), "ms": runs, "best_ms": best}
    out.write_text(json.dumps(record, indent=2))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
