"""Forward-pass throughput of actorlm's ModelRunner beside transformers, same weights, same run.

Prefill: one prompt of --prompt-len tokens. Decode: B sequences with a cached
context of --context-len tokens each, then --decode-steps steps of one token per
sequence (greedy; each side picks its own next tokens). transformers runs its own
forward with its KV cache (DynamicCache) on the model it loads from the same GGUF.

    python bench/forward.py                # default model, batch 1 8 32 64
    python bench/forward.py --skip-transformers --batch-sizes 32
    python bench/forward.py --quantization none,fp16   # one actorlm column each
    python bench/forward.py --model DIR --model-impl native,transformers  # vs the fallback

Any HF folder or GGUF runs (``bench/random_model.py`` builds random ones without a
download: each family's tiny test model, or a released model's real shape).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from actorlm.config import ModelConfig
from actorlm.gpu.loaders.base import model_path
from actorlm.gpu.runner import ModelRunner
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="", help="HF folder or .gguf file (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument("--batch-sizes", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length")
    p.add_argument(
        "--context-len", type=int, default=128, help="cached tokens per sequence before decoding"
    )
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument(
        "--repeats", type=int, default=2, help="runs of each workload per engine (best reported)"
    )
    p.add_argument(
        "--quantization",
        default="fp16",
        help="actorlm linear methods to run, comma-separated (none = plain fp32 weights)",
    )
    p.add_argument(
        "--model-impl",
        default="auto",
        help="actorlm model implementations to run, comma-separated (auto, native, transformers)",
    )
    p.add_argument(
        "--attention-backend",
        default="",
        help="actorlm attention backend (default: the platform's)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--skip-transformers", action="store_true", help="only actorlm")
    p.add_argument("--out", default="bench/results/forward.json", help="raw results (JSON)")
    return p.parse_args()


def cpu_description() -> dict[str, str]:
    """lscpu's model name and flags (which kernels a run could use)."""
    out: dict[str, str] = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Flags"):
            out[key.strip()] = value.strip()
    return out


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class Ours:
    def __init__(
        self,
        path: str,
        threads: int,
        num_pages: int,
        quantization: str,
        attention: str,
        model_impl: str = "auto",
    ) -> None:
        cfg = ModelConfig(
            path=path,
            num_threads=threads,
            num_pages=num_pages,
            quantization=quantization,
            attention_backend=attention,
            model_impl=model_impl,
        )
        self.runner = ModelRunner(cfg)
        self.step = 0

    def _forward(self, seqs: list[SeqStep], release: list[str] | None = None) -> list[int]:
        self.step += 1
        res = self.runner.forward(ForwardBatch(step_id=self.step, seqs=seqs, release=release or []))
        return [r.token_id for r in res.results]

    def prefill_s(self, ids: list[int]) -> float:
        pages = list(range(-(-len(ids) // self.runner.info.page_size)))
        t0 = time.perf_counter()
        self._forward(
            [
                SeqStep(
                    "p",
                    ids,
                    0,
                    pages,
                    True,
                    SeqInit(sampling=GREEDY, token_ids=ids, prompt_len=len(ids)),
                )
            ]
        )
        dt = time.perf_counter() - t0
        self._forward([], release=["p"])
        return dt

    def decode_s(self, prompts: list[list[int]], steps: int) -> float:
        ps = self.runner.info.page_size
        per_seq = -(-(len(prompts[0]) + steps + 1) // ps)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        rids = [f"d{i}" for i in range(len(prompts))]
        first = [
            SeqStep(rid, p, 0, t, True, SeqInit(sampling=GREEDY, token_ids=p, prompt_len=len(p)))
            for rid, p, t in zip(rids, prompts, tables, strict=True)
        ]
        tokens = self._forward(first)
        pos = len(prompts[0])
        tokens = self._forward(
            [SeqStep(r, [tok], pos, t) for r, tok, t in zip(rids, tokens, tables, strict=True)]
        )
        pos += 1  # one untimed decode step warms the decode path
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = self._forward(
                [SeqStep(r, [tok], pos, t) for r, tok, t in zip(rids, tokens, tables, strict=True)]
            )
            pos += 1
        dt = time.perf_counter() - t0
        self._forward([], release=rids)
        return dt


def load_reference_model(path: Path) -> Any:
    """``transformers``' own fp32 model on the same weights (a GGUF is dequantized by it)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


class Transformers:
    def __init__(self, path: Path) -> None:

        self.model = load_reference_model(path)

    @torch.inference_mode()
    def prefill_s(self, ids: list[int]) -> float:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        logits = self.model(
            input_ids=torch.tensor([ids]), cache=DynamicCache(), use_cache=True
        ).logits
        logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def decode_s(self, prompts: list[list[int]], steps: int) -> float:
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(input_ids=torch.tensor(prompts), cache=cache, use_cache=True)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out = self.model(input_ids=tokens, cache=cache, use_cache=True)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=tokens, cache=cache, use_cache=True)
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
                lambda e, p=prompts: e.decode_s(p, args.decode_steps),
            )
        )
    for engine in engines.values():
        engine.prefill_s(ids[:64])  # warm-up
    for key, tokens, run in work:
        for _ in range(args.repeats):
            for name, engine in engines.items():
                res[name][key] = max(res[name].get(key, 0.0), tokens / run(engine))
        line = ", ".join(f"{name} {res[name][key]:.1f}" for name in engines)
        print(f"{key}: {line} tok/s", file=sys.stderr, flush=True)
    return res


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = model_path(ModelConfig(path=args.model))
    max_b = max(int(x) for x in args.batch_sizes.split(","))
    pages = (
        max_b * (-(-(args.context_len + args.decode_steps + 2) // 16) + 1)
        + args.prompt_len // 16
        + 1
    )
    impls = args.model_impl.split(",")
    engines: dict[str, Any] = {
        f"actorlm {q}" + (f" {impl}" if len(impls) > 1 else ""): Ours(
            str(path), args.threads, pages, q, args.attention_backend, impl
        )
        for q in args.quantization.split(",")
        for impl in impls
    }
    first = next(iter(engines.values()))
    vocab = first.runner.info.vocab_size
    results: dict[str, Any] = {
        "model": str(path),
        "threads": torch.get_num_threads(),
        "attention_backend": first.runner.attention_backend,
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_description(),
        "args": vars(args),
    }
    if not args.skip_transformers:
        engines["transformers"] = Transformers(path)
    results.update(measure(engines, args, vocab))

    names = [n for n in engines if n != "transformers"]
    ref = results.get("transformers", {})
    head = ["workload", *(f"{n} tok/s" for n in names)]
    if ref:
        head += ["transformers tok/s", *(f"{n} / transformers" for n in names)]
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for key in results[names[0]]:
        cells = [key, *(f"{results[n][key]:.1f}" for n in names)]
        if ref:
            cells += [f"{ref[key]:.1f}", *(f"{results[n][key] / ref[key]:.2f}x" for n in names)]
        rows.append("| " + " | ".join(cells) + " |")
    print("\n".join(rows))
    cpu = results["cpu"]
    print(f"\n{path.name}, {results['threads']} threads, {cpu.get('Model name', '?')}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
