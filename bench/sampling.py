"""The sampler's time a step on the CPU: the C kernels (``gpu/kernels/sample.py``: the
draw, and the logprobs) against the PyTorch path they replaced (a sort of the vocabulary,
Gumbel-max; log_softmax and topk), for each sampling setting and batch size, over logits
of the default model's vocabulary.

    python bench/sampling.py                       # batch 1, 8, 32; peaked and flat rows
    python bench/sampling.py --batch-sizes 1,64 --vocab 151936

Logits are random normal times --scales (3: a peaked row, a nucleus of tens of tokens at
top_p 0.95; 0.5: a flat one, of tens of thousands): the C kernel's time depends on how
many tokens a cut keeps, PyTorch's does not. Prints a table; raw results to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/sampling.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.gpu import sampling  # noqa: E402
from actorlm.gpu.sampling import Sampler  # noqa: E402
from actorlm.messages.sampling import SamplingParams  # noqa: E402
from actorlm.messages.step import SeqInit  # noqa: E402

from bench import machine  # noqa: E402

PROMPT = [(7 * i) % 1000 + 1 for i in range(300)]  # 250 prompt tokens, 50 out: penalties' history
SETTINGS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "top_k 40, top_p 0.9, t 0.7": {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
    # the rest beside top_p 0.95: only the draw differs between the columns
    "+ repetition_penalty 1.1": {"temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.1},
    "+ frequency 0.5, presence 0.3": {
        "temperature": 1.0,
        "top_p": 0.95,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
    },
    "+ logprobs, top 5": {"temperature": 1.0, "top_p": 0.95, "logprobs": True, "top_logprobs": 5},
    "greedy + logprobs, top 20": {"temperature": 0.0, "logprobs": True, "top_logprobs": 20},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--vocab", type=int, default=49152, help="the default model's")
    p.add_argument("--scales", default="3,0.5", help="logits' standard deviations")
    p.add_argument("--iters", type=int, default=30, help="timed steps a cell (median)")
    p.add_argument("--out", default="bench/results/sampling.json")
    return p.parse_args()


def step_ms(
    path: str, params: dict[str, float], batch: int, vocab: int, scale: float, iters: int
) -> float:
    """The median time of one ``Sampler.sample`` call over ``batch`` rows."""
    sampler = Sampler(vocab, torch.device("cpu"))
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        init = SeqInit(sampling=SamplingParams(**params), token_ids=PROMPT, prompt_len=250)
        sampler.add(rid, init)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * scale
    own, own_lp = sampling.native_sample, sampling.logprob_rows
    if path == "torch":
        sampling.native_sample = lambda level="": None  # type: ignore[assignment]
        sampling.logprob_rows = lambda *a, **k: None  # type: ignore[assignment]
    try:
        sampler.sample(rids, logits)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            sampler.sample(rids, logits)
            times.append(time.perf_counter() - t0)
    finally:
        sampling.native_sample, sampling.logprob_rows = own, own_lp  # type: ignore[assignment]
    return statistics.median(times) * 1e3


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    scales = [float(s) for s in args.scales.split(",")]
    rows = []
    for scale in scales:
        for name, params in SETTINGS.items():
            if name == "greedy" and scale != scales[0]:
                continue  # an argmax does not care how peaked the row is
            for b in batches:
                c = step_ms("c", params, b, args.vocab, scale, args.iters)
                t = step_ms("torch", params, b, args.vocab, scale, max(3, args.iters // 5))
                rows.append({"setting": name, "scale": scale, "batch": b, "c_ms": c, "torch_ms": t})
                print(
                    f"{name}, scale {scale}, b={b}: C {c:.3f} ms, PyTorch {t:.3f} ms",
                    file=sys.stderr,
                )
    m = machine.describe()
    print(f"\n{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}; vocab {args.vocab}, "
          f"torch threads {torch.get_num_threads()}\n")  # fmt: skip
    print("| setting | logits scale | batch | C ms a step | PyTorch ms a step | PyTorch / C |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['setting']} | {r['scale']} | {r['batch']} | {r['c_ms']:.3f} | "
              f"{r['torch_ms']:.3f} | {r['torch_ms'] / r['c_ms']:.1f}x |")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
