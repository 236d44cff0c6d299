"""Forward-pass throughput of actorlm's ModelRunner beside the machine's limits measured
in the same run (and beside transformers on the same weights).

Prefill: one prompt of --prompt-len tokens. Decode: B sequences with a cached
context of --context-len tokens each, then --warmup-steps untimed and --decode-steps
timed steps of one token per sequence (greedy): the steady state. The first steps after
a prompt (or after idling) read weights the prompt's pass pushed out of the last-level
cache, at DRAM speed, and run up to ~1.5x slower (bench/residency.py, bench/README.md).
One actorlm column per (dtype, linear method). Beside each figure:

- decode: the bytes a step must read (the weights as the step's path keeps them, and
  the KV it attends to) over the measured read bandwidth, as tok/s;
- prefill: the step's FLOPs over the best GEMM throughput measured in the dtype its
  linear layers run (bf16: torch's bf16 GEMM; float32 with gguf/fp16: fbgemm's
  fp16-weight GEMM; float32 with none: torch's fp32 GEMM; the *_a8 methods: torch's
  int8 GEMM), as tok/s.

    python bench/forward.py                  # the CPU defaults (dtype auto, gguf), b=1 8 32
    python bench/forward.py --dtypes float32,bfloat16 --quantization gguf,none
    python bench/forward.py --skip-transformers --batch-sizes 1 --decode-steps 32
    python bench/forward.py --model DIR --model-impl native,transformers  # vs the fallback

Any HF folder or GGUF runs (``bench/random_model.py`` builds random ones without a
download: each family's tiny test model, or a released model's real shape).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/forward.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.config import ModelConfig  # noqa: E402
from actorlm.gpu.loaders.base import model_path  # noqa: E402
from actorlm.gpu.runner import ModelRunner  # noqa: E402
from actorlm.messages.sampling import SamplingParams  # noqa: E402
from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep  # noqa: E402

from bench import machine  # noqa: E402
from bench.forward_limits import Limits, decode_bytes, gemm_kind, prefill_flops  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="", help="HF folder or .gguf file (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length")
    p.add_argument(
        "--context-len", type=int, default=128, help="cached tokens per sequence before decoding"
    )
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument(
        "--warmup-steps", type=int, default=8, help="untimed decode steps before the timed ones"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="runs of each workload per engine (best reported)"
    )
    p.add_argument(
        "--dtypes", default="auto", help="actorlm dtypes, comma-separated (auto, float32, bfloat16)"
    )
    p.add_argument("--quantization", default="gguf", help="actorlm linear methods, comma-separated")
    p.add_argument(
        "--model-impl",
        default="auto",
        help="actorlm model implementations, comma-separated (auto, native, transformers)",
    )
    p.add_argument(
        "--fused-decode-max-batch",
        type=int,
        default=-1,
        help="decode steps up to this batch as one native call (0: off; -1: the default)",
    )
    p.add_argument(
        "--attention-backend",
        default="",
        help="actorlm attention backend (default: the platform's)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument(
        "--transformers-dtypes",
        default="float32",
        help="transformers columns, comma-separated dtypes (bfloat16: like with like beside "
        "actorlm's bf16, which dtype auto picks on CPUs with native bf16)",
    )
    p.add_argument("--skip-transformers", action="store_true", help="only actorlm")
    p.add_argument("--out", default="bench/results/forward.json", help="raw results (JSON)")
    return p.parse_args()


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class Ours:
    def __init__(
        self, path: str, args: argparse.Namespace, pages: int, dtype: str, q: str, impl: str
    ) -> None:
        extra = {}
        if args.fused_decode_max_batch >= 0:
            extra["fused_decode_max_batch"] = args.fused_decode_max_batch
        cfg = ModelConfig(
            path=path,
            dtype=dtype,
            num_threads=args.threads,
            num_pages=pages,
            quantization=q,
            attention_backend=args.attention_backend,
            model_impl=impl,
            **extra,
        )
        self.runner = ModelRunner(cfg)
        gc.freeze()  # as the worker does once its runner is built
        self.step = 0

    def _forward(self, seqs: list[SeqStep], release: list[str] | None = None) -> list[int]:
        self.step += 1
        res = self.runner.forward(ForwardBatch(step_id=self.step, seqs=seqs, release=release or []))
        return [r.token_id for r in res.results]

    def prefill_s(self, ids: list[int]) -> float:
        pages = list(range(-(-len(ids) // self.runner.info.page_size)))
        init = SeqInit(sampling=GREEDY, token_ids=ids, prompt_len=len(ids))
        t0 = time.perf_counter()
        self._forward([SeqStep("p", ids, 0, pages, True, init)])
        dt = time.perf_counter() - t0
        self._forward([], release=["p"])
        return dt

    def decode_s(self, prompts: list[list[int]], steps: int, warmup: int) -> float:
        ps = self.runner.info.page_size
        per_seq = -(-(len(prompts[0]) + warmup + steps + 1) // ps)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        rids = [f"d{i}" for i in range(len(prompts))]
        first = [
            SeqStep(rid, p, 0, t, True, SeqInit(sampling=GREEDY, token_ids=p, prompt_len=len(p)))
            for rid, p, t in zip(rids, prompts, tables, strict=True)
        ]
        tokens = self._forward(first)
        pos = len(prompts[0])

        def step() -> list[int]:
            return self._forward(
                [SeqStep(r, [tok], pos, t) for r, tok, t in zip(rids, tokens, tables, strict=True)]
            )

        for _ in range(warmup):
            tokens = step()
            pos += 1
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = step()
            pos += 1
        dt = time.perf_counter() - t0
        self._forward([], release=rids)
        return dt


class Transformers:
    """``transformers``' own model on the same weights (a GGUF is dequantized by it)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        kw: dict[str, Any] = {"dtype": dtype}
        if path.suffix == ".gguf":
            kw["gguf_file"] = path.name
        src = path.parent if path.suffix == ".gguf" else path
        self.model = AutoModelForCausalLM.from_pretrained(str(src), **kw).eval()
        # the cache's keyword: `cache` in recent transformers, `past_key_values` before (a
        # wrong one is swallowed by **kwargs and the model runs without its cache)
        params = inspect.signature(self.model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"

    def _cache(self) -> dict[str, Any]:
        from transformers import DynamicCache

        return {self.cache_key: DynamicCache()}

    @torch.inference_mode()
    def prefill_s(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, **self._cache())
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def decode_s(self, prompts: list[list[int]], steps: int, warmup: int) -> float:
        cache = self._cache()
        out = self.model(input_ids=torch.tensor(prompts), use_cache=True, **cache)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        for _ in range(warmup):
            out = self.model(input_ids=tokens, use_cache=True, **cache)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=tokens, use_cache=True, **cache)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t0


def measure(
    engines: dict[str, Any], args: argparse.Namespace, vocab: int
) -> dict[str, dict[str, float]]:
    """Each workload runs on every engine in turn, --repeats times, best kept: on a shared
    machine the load drifts, and interleaving exposes both sides to the same drift."""
    res: dict[str, dict[str, float]] = {name: {} for name in engines}
    ids = prompt_ids(args.prompt_len, 0, vocab)
    work: list[tuple[str, int, Any]] = [
        (f"prefill {args.prompt_len}", args.prompt_len, lambda e: e.prefill_s(ids))
    ]
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [prompt_ids(args.context_len, 1 + i, vocab) for i in range(b)]
        work.append(
            (
                f"decode b={b}",
                b * args.decode_steps,
                lambda e, p=prompts: e.decode_s(p, args.decode_steps, args.warmup_steps),
            )
        )
    for engine in engines.values():  # warm-up: the whole prompt, whose first run grows
        engine.prefill_s(ids)  # the kernels' scratch and faults in its KV pages
    for key, tokens, run in work:
        for _ in range(args.repeats):
            for name, engine in engines.items():
                res[name][key] = max(res[name].get(key, 0.0), tokens / run(engine))
        line = ", ".join(f"{name} {res[name][key]:.1f}" for name in engines)
        print(f"{key}: {line} tok/s", file=sys.stderr, flush=True)
    return res


def limits_of(runner: ModelRunner, args: argparse.Namespace, lim: Limits) -> dict[str, float]:
    """Each workload's limit in tok/s for this engine."""
    out = {}
    kind = gemm_kind(runner)
    flops = prefill_flops(runner.model, runner.info, args.prompt_len)
    out[f"prefill {args.prompt_len}"] = args.prompt_len / (
        flops / lim.gemm(kind, runner, args.prompt_len)
    )
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        context = args.context_len + args.warmup_steps + args.decode_steps // 2  # timed mean
        nbytes = decode_bytes(runner, b, context)
        out[f"decode b={b}"] = b / (nbytes / lim.bandwidth)
    return out


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(ModelConfig(path=args.model))
    max_b = max(int(x) for x in args.batch_sizes.split(","))
    pages = (
        max_b * (-(-(args.context_len + args.warmup_steps + args.decode_steps + 2) // 16) + 1)
        + args.prompt_len // 16
        + 1
    )
    engines: dict[str, Any] = {}
    impls = args.model_impl.split(",")
    for d in args.dtypes.split(","):
        for q in args.quantization.split(","):
            for impl in impls:
                try:
                    engine = Ours(str(path), args, pages, d, q, impl)
                except ValueError as e:  # fp16 in bfloat16, say
                    print(f"skipping {d} {q} {impl}: {e}", file=sys.stderr)
                    continue
                name = f"actorlm {engine.runner.cfg.dtype} {q}"
                engines[name + (f" {impl}" if len(impls) > 1 else "")] = engine
    first = next(iter(engines.values()))
    lim = Limits()
    results: dict[str, Any] = {
        "model": str(path),
        "machine": machine.describe(),
        "attention_backend": first.runner.attention_backend,
        "args": vars(args),
        "read_bandwidth_gbs": lim.bandwidth / 1e9,
    }
    limits = {name: limits_of(e.runner, args, lim) for name, e in engines.items()}
    results["gemm_gflops"] = {k: v / 1e9 for k, v in lim.measured.items()}
    results["limits_tok_s"] = limits
    if not args.skip_transformers:
        for name in args.transformers_dtypes.split(","):
            dtype = getattr(torch, name)
            engines[f"transformers {'fp32' if dtype == torch.float32 else name}"] = Transformers(
                path, dtype
            )
    results["tok_s"] = measure(engines, args, first.runner.info.vocab_size)
    print_table(results, limits)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nraw results: {out}")


def print_table(results: dict[str, Any], limits: dict[str, dict[str, float]]) -> None:
    m = results["machine"]
    print(
        f"\n{m['cpu']}, {m['cores']} cores, flags {' '.join(m['isa_flags'])}; "
        f"read {results['read_bandwidth_gbs']:.1f} GB/s; GEMM GFLOP/s "
        + ", ".join(f"{k} {v:.0f}" for k, v in results["gemm_gflops"].items())
        + "\n"
    )
    tok = results["tok_s"]
    names = list(tok)
    head = ["workload"]
    for n in names:
        head += [f"{n} tok/s"] + (["limit tok/s", "limit / actual"] if n in limits else [])
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for key in tok[names[0]]:
        cells = [key]
        for n in names:
            cells.append(f"{tok[n][key]:.1f}")
            if n in limits:
                cells += [f"{limits[n][key]:.1f}", f"{limits[n][key] / tok[n][key]:.2f}x"]
        rows.append("| " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
