"""How far each dtype and linear method moves the model's next-token distributions from
a reference run, over real text, teacher-forced (ModelRunner, no actors).

Each of ``--batch`` passages (paragraphs of the repository's own Markdown, tokenized)
is prefilled for ``--prefix`` tokens, then fed its next ``--steps`` tokens one decode
step at a time, all passages in one batch: every step is a real decode step (the fused
native step where the model has one). At every position the logits of each run are
compared with the reference's (the first of ``--runs``): top-1 agreement, KL(ref || run)
in nats, the largest logit difference; and each run's own perplexity of the text.

    python bench/logit_drift.py   # float32:gguf (reference), bfloat16:gguf, bfloat16:gguf_a8
    python bench/logit_drift.py --runs float32:none,float32:gguf,float32:gguf_a8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/logit_drift.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.config import ModelConfig  # noqa: E402
from actorlm.gpu.forward_meta import SeqSpec  # noqa: E402
from actorlm.gpu.loaders.base import model_path  # noqa: E402
from actorlm.gpu.runner import ModelRunner  # noqa: E402

from bench import machine  # noqa: E402
from bench.workloads import load_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="", help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument(
        "--runs",
        default="float32:gguf,bfloat16:gguf,bfloat16:gguf_a8",
        help="dtype:quantization pairs, comma-separated; the first is the reference",
    )
    p.add_argument("--batch", type=int, default=8, help="passages, decoded together")
    p.add_argument("--prefix", type=int, default=32, help="tokens prefilled before the steps")
    p.add_argument("--steps", type=int, default=96, help="forced decode steps a passage")
    p.add_argument("--out", default="bench/results/logit_drift.json", help="raw results (JSON)")
    return p.parse_args()


def passages(tokenizer: object, n: int, length: int) -> list[list[int]]:
    """``n`` stretches of ``length`` tokens from the repository's Markdown, one a file."""
    out: list[list[int]] = []
    for path in sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")]):
        ids = tokenizer.encode(path.read_text())  # type: ignore[attr-defined]
        for start in range(0, len(ids) - length, max(length, len(ids) // 3)):
            out.append(ids[start : start + length])
            if len(out) == n:
                return out
    raise SystemExit(f"only {len(out)} passages of {length} tokens in the Markdown")


def forced_logits(runner: ModelRunner, texts: list[list[int]], prefix: int) -> torch.Tensor:
    """[steps + 1, batch, vocab] fp32: the logits after the prefix and after each forced token."""
    page = runner.info.page_size
    per = -(-len(texts[0]) // page)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(texts))]
    rows = [runner.run([SeqSpec(t[:prefix], 0, tables[i]) for i, t in enumerate(texts)]).float()]
    for pos in range(prefix, len(texts[0]) - 1):
        seqs = [SeqSpec([t[pos]], pos, tables[i][: pos // page + 1]) for i, t in enumerate(texts)]
        rows.append(runner.run(seqs).float())
    return torch.stack(rows)


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    lp_ref, lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).flatten()
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return {
        "top1_agree": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "max_abs_logit": (ref - got).abs().max().item(),
        "perplexity": nll.mean().exp().item(),
    }


def main() -> None:
    args = parse_args()
    path = model_path(ModelConfig(path=args.model))
    tokenizer = load_tokenizer(path if path.is_dir() else None, None if path.is_dir() else path)
    texts = passages(tokenizer, args.batch, args.prefix + args.steps + 1)
    targets = torch.tensor([t[args.prefix :] for t in texts]).T  # [steps + 1, batch]
    pages = args.batch * -(-len(texts[0]) // 16) + 1
    runs = [r.split(":") for r in args.runs.split(",")]
    results: list[dict[str, object]] = []
    ref: torch.Tensor | None = None
    print(
        "| run | top-1 agrees with the reference | KL mean / p99 (nats) | max logit diff | perplexity |"
    )
    print("|---|---:|---:|---:|---:|")
    for dtype, quant in runs:
        cfg = ModelConfig(path=str(path), dtype=dtype, quantization=quant, num_pages=pages)
        logits = forced_logits(ModelRunner(cfg), texts, args.prefix)
        ref = logits if ref is None else ref
        row = compare(ref, logits, targets)
        results.append({"dtype": dtype, "quantization": quant, **row})
        print(
            f"| {dtype} {quant} | {row['top1_agree']:.2%} | {row['kl_mean']:.5f} / "
            f"{row['kl_p99']:.5f} | {row['max_abs_logit']:.3f} | {row['perplexity']:.3f} |",
            flush=True,
        )
    print(
        f"\n{machine.describe()}; {args.batch} passages x {args.steps + 1} positions, reference {args.runs.split(',')[0]}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(path), "machine": machine.describe(), "args": vars(args)}
    out.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
