"""Linear layers of the default model by row count: fp32 (PyTorch), fp16 (fbgemm) and
the GGUF block kernel (``gpu/kernels/cpu_qgemm.c``) in each ISA build this CPU runs,
each on that layer's own weights.

Sets ``GGUFLinear.KERNEL_MAX_ROWS``: the kernel wins while a batch is small
(decode), fbgemm's fp16 GEMM once it is large (prefill). Where the best build has
them, two more columns: the blocks against rows rounded to bf16 (``act_bf16``, a bf16
model's path) and quantized to int8 (``act_int8``, the ``*_a8`` methods).

    python bench/qgemm.py                       # rows 1 2 4 8 16 32 64 256
    python bench/qgemm.py --rows 8 --layers blk.0.ffn_down.weight
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/qgemm.py` from anywhere
    sys.path.insert(0, str(REPO))

from actorlm.config import ModelConfig  # noqa: E402
from actorlm.gpu.gguf_file import GGUFFile  # noqa: E402
from actorlm.gpu.kernels import native  # noqa: E402
from actorlm.gpu.kernels.qgemm import Lin, int8_ready, lin_blocks, linear, pack  # noqa: E402
from actorlm.gpu.loaders.base import model_path  # noqa: E402
from actorlm.gpu.quantization import Fp16Linear  # noqa: E402

from bench import machine  # noqa: E402

LAYERS = "blk.0.attn_q.weight,blk.0.attn_k.weight,blk.0.ffn_up.weight,blk.0.ffn_down.weight,token_embd.weight"


def best_ms(fn, x: torch.Tensor, min_s: float) -> float:  # type: ignore[no-untyped-def]
    fn(x)
    best, spent, n = float("inf"), 0.0, 0
    while spent < min_s or n < 3:
        t0 = time.perf_counter()
        fn(x)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--layers", default=LAYERS, help="GGUF tensor names, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="rows of x, comma-separated")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--out", default="bench/results/qgemm.json", help="raw results (JSON)")
    args = p.parse_args()

    path = model_path(ModelConfig(path=args.model))
    file = GGUFFile(path)
    results: list[dict[str, object]] = []
    levels = [i.name for i in native.supported_isas(native.cpu_flags(), native._is_x86())]
    levels = [lv for lv in levels if lv != "generic"] or ["generic"]
    best = native.best_isa().name
    rows_as = (["bf16"] if best in ("avx512bf16", "amx") else []) + (
        ["int8"] if int8_ready() else []
    )
    names = [f"blocks {lv}" for lv in levels] + [f"{a} rows {best}" for a in rows_as]
    cols = " | ".join(f"{n} ms" for n in names)
    print(f"| layer | N x K | format | rows | fp32 ms | fp16 ms | {cols} | fp16 / blocks {best} |")
    print("|---|---|---|---:|---:|---:|" + "---:|" * (len(names) + 1))
    for name in args.layers.split(","):
        w = torch.from_numpy(file.dequantize(name).copy()).float()
        packed = pack(w)
        if packed is None:
            print(f"| {name} | {tuple(w.shape)} | not a block format | | | | | |")
            continue
        fp16 = Fp16Linear(w, None)
        lin = lin_blocks(packed)
        lins = {a: Lin.from_buffer_copy(lin) for a in rows_as}
        for a, copy in lins.items():
            setattr(copy, f"act_{a}", 1)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, w.shape[1])
            ms = {
                "fp32": best_ms(lambda x, w=w: F.linear(x, w), x, args.min_time),
                "fp16": best_ms(fp16, x, args.min_time),
            }
            for lv in levels:
                ms[f"blocks {lv}"] = best_ms(
                    lambda x, lv=lv, lin=lin: linear(x, lin, lv), x, args.min_time
                )
            for a, copy in lins.items():
                ms[f"{a} rows {best}"] = best_ms(
                    lambda x, copy=copy: linear(x, copy), x, args.min_time
                )
            results.append({"layer": name, "shape": list(w.shape), "kind": packed.kind,
                            "rows": rows, "ms": ms})  # fmt: skip
            blocks = " | ".join(f"{ms[n]:.3f}" for n in names)
            print(
                f"| {name} | {w.shape[0]} x {w.shape[1]} | {packed.kind} | {rows} | "
                f"{ms['fp32']:.3f} | {ms['fp16']:.3f} | {blocks} | "
                f"{ms['fp16'] / ms[f'blocks {best}']:.2f}x |",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(path), "threads": torch.get_num_threads(),
            "machine": machine.describe(), "isa": best}  # fmt: skip
    out.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
