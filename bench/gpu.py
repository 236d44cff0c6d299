"""actorlm on a CUDA GPU at Llama-3-8B's shape (random bf16 weights, no download), beside
the device's physical limits measured in the same run.

- limits: device copy bandwidth (a 4 GiB buffer copied: bytes read + written per second)
  and a large bf16 matmul's throughput (8192^3);
- decode: the step time (forward, sampling, CUDA-graph replay where captured) at batch
  1, 16, 64 and 256 over ``--context-len`` cached tokens per sequence, the graph's replay
  alone (the device's share, without the host's work between steps), beside its bounds:
  bandwidth (weights + the batch's K/V read once, over the copy bandwidth) and compute
  (2 x parameters x batch, plus attention, over the matmul throughput);
- offline: ``--num-requests`` requests of ``--input-len`` tokens, ``--output-len`` out
  each (greedy, ignore_eos), all at once through ``actorlm.Engine`` (every actor in this
  process), in output and total tokens per second.

Targets (issue 20): batch-1 decode within 1.3x of its bandwidth bound; batch 256 at
>= 50% of the matmul throughput (at ``--context-len 1024`` the K/V reads of batch 256
weigh twice the weights, so its bandwidth bound is the higher one: both are shown).

    python bench/gpu.py                                  # the platform's default backend
    python bench/gpu.py --attention-backends flashinfer,triton
    python bench/gpu.py --smoke                          # tiny shape, any device: checks the script

Writes ``--out`` (JSON; default ``bench/results/gpu.json``) and prints a Markdown table.
Without CUDA it refuses (``--smoke`` aside).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/gpu.py` from anywhere
    sys.path.insert(0, str(REPO))

DECODE_TARGET = 1.3  # batch-1 step time over its bandwidth bound, at most
MATMUL_TARGET = 0.5  # batch-256 achieved FLOP/s over the matmul's, at least


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--attention-backends", default="", help="comma-separated; default: the platform's"
    )
    p.add_argument("--batch-sizes", default="1,16,64,256", help="decode batch sizes")
    p.add_argument(
        "--context-len", type=int, default=1024, help="cached tokens per decode sequence"
    )
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="the engine's step budget")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode steps run eagerly")
    p.add_argument("--skip-offline", action="store_true", help="limits and decode steps only")
    p.add_argument(
        "--profile-batch",
        type=int,
        default=0,
        help="also profile this batch size's timed steps: the kernels by device time",
    )
    p.add_argument(
        "--smoke", action="store_true", help="a tiny model on any device (checks the script)"
    )
    p.add_argument("--out", default="bench/results/gpu.json", help="raw results (JSON)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "flashinfer"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as such
            info[name] = None
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Flags"):
            info["cpu_" + key.strip().split()[0].lower()] = value.strip()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
        )
    return info


# -- physical limits ----------------------------------------------------------------------------
def _timed(fn: Any, iters: int, device: Any) -> float:
    """Seconds per call of ``fn`` (after a warm-up call), timed on the device."""
    import torch

    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def limits(device: Any, smoke: bool) -> dict[str, float]:
    import torch

    nbytes = (64 << 20) if smoke else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(
        1
    )  # touched, not the zero page
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), 20, device)
    n = 1024 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _timed(lambda: a @ b, 20, device)
    return {
        "copy_bandwidth_gbs": 2 * nbytes / copy_s / 1e9,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
    }


# -- decode steps -----------------------------------------------------------------------------------
def make_runner(
    path: Path, backend: str, device: str, dtype: str, num_pages: int, args: Any
) -> Any:
    from actorlm.config import ModelConfig
    from actorlm.gpu.runner import ModelRunner

    cfg = ModelConfig(
        path=str(path),
        load_format="random",
        device=device,
        dtype=dtype,
        attention_backend=backend,
        num_pages=num_pages,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=max(int(b) for b in args.batch_sizes.split(",")),
    )
    return ModelRunner(cfg)


def decode_step_s(
    runner: Any,
    batch: int,
    context: int,
    steps: int,
    chunk: int,
    sync: Any,
    profile: Any = None,
    replay: list[float] | None = None,
) -> float:
    """Prefill ``batch`` sequences of ``context`` tokens (a few per step), then time
    ``steps`` decode steps of the whole batch; seconds per step. With ``profile`` (a
    callable taking a zero-argument function) the timed steps run once more under it;
    with ``replay`` (a list) and a graph for the batch, the seconds of its replay alone
    (no host work between) are appended to it."""
    from actorlm.gpu.forward_meta import SeqSpec
    from actorlm.messages.sampling import SamplingParams
    from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    ps = runner.info.page_size
    per_seq = -(-(context + 2 * steps + 4) // ps)  # the timed steps, profiled steps
    rng = random.Random(batch)
    vocab = runner.info.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(context)] for _ in range(batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    rids = [f"b{batch}-{i}" for i in range(batch)]
    last: dict[str, int] = {}
    step_id = 0

    def forward(seqs: list[Any], release: list[str] | None = None) -> None:
        nonlocal step_id
        step_id += 1
        res = runner.forward(ForwardBatch(step_id=step_id, seqs=seqs, release=release or []))
        last.update((r.rid, r.token_id) for r in res.results)

    per_step = max(1, chunk // context)
    for i in range(0, batch, per_step):
        forward(
            [
                SeqStep(r, p, 0, t, True, SeqInit(sampling=greedy, token_ids=p, prompt_len=context))
                for r, p, t in zip(
                    rids[i : i + per_step],
                    prompts[i : i + per_step],
                    tables[i : i + per_step],
                    strict=True,
                )
            ]
        )

    def decode(pos: int) -> None:
        forward([SeqStep(r, [last[r]], pos, t, True) for r, t in zip(rids, tables, strict=True)])

    decode(context)  # warm-up (a graph's first replay, the allocator)
    decode(context + 1)
    sync()
    t0 = time.perf_counter()
    for s in range(steps):
        decode(context + 2 + s)  # each step ends in the sampled tokens' copy to the host
    dt = (time.perf_counter() - t0) / steps
    if (
        replay is not None
        and runner.graphs is not None
        and runner.graphs.can_run([SeqSpec([0], 0, [0])] * batch)
    ):  # the same steps' graph alone, back to back: the device's share of a step
        replay.append(_timed(lambda: runner.graphs.replay_again(batch), steps, runner.device))
    if profile is not None:
        profile(lambda: [decode(context + 2 + steps + s) for s in range(steps)])
    forward([], release=rids)
    return dt


def profile_kernels(label: str, out: Path) -> Any:
    """A profiler for ``decode_step_s``: the device kernels of the steps it runs, by
    total device time, printed and written beside ``out`` (``<out>.profile-<label>.txt``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def run(fn: Any) -> None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
        out.with_suffix(f".profile-{label}.txt").write_text(table + "\n")
        log(table)

    return run


def bounds(
    info: Any, params: int, weight_bytes: int, batch: int, context: int, lim: dict[str, float]
) -> dict[str, float]:
    """A decode step's lower bounds: every weight and the batch's K/V read once at the
    copy bandwidth; its matmul FLOPs (the embedding is a lookup) at the matmul's rate."""
    from actorlm.gpu.model_info import kv_bytes_per_token

    kv = batch * context * kv_bytes_per_token(info, info.dtype or "bfloat16")
    embed = info.vocab_size * info.hidden_size
    attn = 4 * batch * context * info.num_layers * info.num_heads * info.head_dim
    flops = 2 * (params - embed) * batch + attn
    return {
        "bandwidth_bound_ms": (weight_bytes + kv) / (lim["copy_bandwidth_gbs"] * 1e9) * 1e3,
        "compute_bound_ms": flops / (lim["matmul_tflops"] * 1e12) * 1e3,
        "flops": flops,
    }


def run_decode(
    path: Path, backend: str, device: str, dtype: str, lim: dict[str, float], args: Any
) -> tuple[str, list[dict[str, Any]]]:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    per_seq = -(-(args.context_len + 2 * args.decode_steps + 4) // 16)
    import torch

    runner = make_runner(path, backend, device, dtype, max(sizes) * per_seq + 1, args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    params = sum(p.numel() for p in runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rows = []
    for b in sizes:
        prof = None
        if b == args.profile_batch and device == "cuda":
            prof = profile_kernels(f"{backend or 'default'}-b{b}", Path(args.out))
        replay: list[float] = []
        step_s = decode_step_s(
            runner, b, args.context_len, args.decode_steps, args.max_prefill_tokens, sync, prof,
            replay,
        )  # fmt: skip
        bound = bounds(runner.info, params, weight_bytes, b, args.context_len, lim)
        row = {
            "batch": b,
            "step_ms": step_s * 1e3,
            "replay_ms": replay[0] * 1e3 if replay else None,
            "tokens_per_s": b / step_s,
            **bound,
            "over_bandwidth_bound": step_s * 1e3 / bound["bandwidth_bound_ms"],
            "share_of_matmul": bound["flops"] / step_s / (lim["matmul_tflops"] * 1e12),
        }
        log(f"{runner.attention_backend} decode batch {b}: {row['step_ms']:.2f} ms/step")
        rows.append(row)
    name = runner.attention_backend
    del runner
    _free()
    return name, rows


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- offline throughput -----------------------------------------------------------------------------
def run_offline(path: Path, backend: str, device: str, dtype: str, args: Any) -> dict[str, Any]:
    from actorlm import Engine

    from bench.offline import random_workload, run_actorlm, summarize

    options: dict[str, Any] = dict(
        load_format="random",
        device=device,
        dtype=dtype,
        attention_backend=backend,
        max_running_requests=args.num_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        disable_cuda_graph=args.disable_cuda_graph,
        enable_prefix_cache=False,  # random prompts share nothing
    )
    if device == "cpu":
        options["kv_cache_gb"] = 0.5
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    n, i, o = args.num_requests, args.input_len, args.output_len
    reqs = random_workload(n, (i, i), (o, o), vocab, seed=0)
    t0 = time.perf_counter()
    with Engine(str(path), placement="inproc", **options) as engine:
        log(f"engine ({backend or 'default'}) up in {time.perf_counter() - t0:.1f} s")
        run = run_actorlm(engine, "actorlm", "random", reqs, reqs[0].input_ids[:8])
    _free()
    return summarize(run, reqs)


# -- report ---------------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    m, lim = results["machine"], results["limits"]
    lines = [
        f"{m.get('device', 'no GPU')} (sm {m.get('capability', '-')}), torch {m['torch']}, "
        f"CUDA {m['cuda']}, triton {m['triton']}, flashinfer {m['flashinfer']}; CPU {m.get('cpu_model')}",
        f"limits: copy bandwidth {lim['copy_bandwidth_gbs']:.0f} GB/s, "
        f"matmul {lim['matmul_tflops']:.0f} TFLOP/s",
        "",
        "| backend | batch | step ms | replay ms | tok/s | bandwidth bound ms | x bound | compute bound ms | % of matmul |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for backend, rows in results["decode"].items():
        for r in rows:
            replay = "-" if r.get("replay_ms") is None else f"{r['replay_ms']:.2f}"
            lines.append(
                f"| {backend} | {r['batch']} | {r['step_ms']:.2f} | {replay} | {r['tokens_per_s']:.0f} | "
                f"{r['bandwidth_bound_ms']:.2f} | {r['over_bandwidth_bound']:.2f}x | "
                f"{r['compute_bound_ms']:.2f} | {100 * r['share_of_matmul']:.0f}% |"
            )
    if results["offline"]:
        lines += [
            "",
            "| backend | requests | output tok/s | total tok/s | seconds |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for backend, s in results["offline"].items():
            lines.append(
                f"| {backend} | {s['requests']} | {s['output_tokens_per_s']:.0f} | "
                f"{s['total_tokens_per_s']:.0f} | {s['total_s']:.1f} |"
            )
    lines += [
        "",
        f"targets: batch 1 within {DECODE_TARGET}x of its bandwidth bound; "
        f"batch 256 at >= {MATMUL_TARGET:.0%} of the matmul throughput",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print(
            "bench/gpu.py: needs a CUDA device (torch.cuda.is_available() is False); "
            "--smoke checks the script on this machine",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from bench.random_weights import LLAMA3_8B, SMOKE, register, write_model

    register()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    if args.smoke:
        args.batch_sizes, args.context_len, args.decode_steps = "1,4", 64, 4
        args.num_requests, args.input_len, args.output_len = 8, 64, 16
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    log(f"device: {results['machine'].get('device', 'cpu')}")
    results["limits"] = limits(torch.device(device), args.smoke)
    log(f"limits: {results['limits']}")
    backends = [b for b in args.attention_backends.split(",") if b] or [""]
    results["decode"], results["offline"] = {}, {}
    with tempfile.TemporaryDirectory(prefix="actorlm-gpu-bench-") as tmp:
        path = write_model(Path(tmp) / "model", SMOKE if args.smoke else LLAMA3_8B)
        for backend in backends:
            name, rows = run_decode(path, backend, device, dtype, results["limits"], args)
            results["decode"][name] = rows
            if not args.skip_offline:
                results["offline"][name] = run_offline(path, backend, device, dtype, args)
    table = markdown(results)
    print(table)
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    log(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
