"""The machine's ceiling for a serving level: the least time its work can take here.

A level's work is fixed by its requests: the prompt tokens no earlier request shares
(with a perfect prefix cache, a shared system prompt is computed once), the output
tokens, and the concurrency that bounds how many rows a decode step can hold. Its
cost on this machine, for the model's GGUF:

- FLOPs: every linear layer for each prompt token computed and each decoded token,
  the LM head for each output token, causal attention (QK^T and PV) for each query
  over the positions it sees;
- bytes: the weights (the GGUF's own blocks: fewer bytes than any dense copy) once a
  decode step, over at least ``ceil(decoded / concurrency)`` steps, and each decoded
  token's K and V in 16-bit (every engine here keeps 16 or 32 bits) over the tokens
  only its own request holds (what requests share is counted as free: read once for
  all of them at best).

``floor_s = max(FLOPs / best GEMM, bytes / read bandwidth)``, both measured in the
same run (``bench/machine.py``): the roofline with compute and memory fully
overlapped, so no engine can beat it. ``ceiling = output tokens / floor_s``. The TTFT
floor of a request is that of its own prefill alone on the machine: its uncached
tokens through the model, reading the weights and the cached tokens' K and V once; a
level's TTFT p50 cannot be below the median of those.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelCost", "level_floor", "measure_limits", "prefix_split"]

KV_BYTES = 2  # bytes a cached K or V element: bf16 / fp16, the least any engine here keeps


@dataclass(frozen=True)
class ModelCost:
    """What a token costs the model: multiply-adds and bytes, per layer where it varies."""

    linear_params: int  # multiply-adds a token through the layers' linears (active experts)
    head_params: int  # the LM head's (vocab x hidden)
    weight_bytes: int  # the layers' and the head's stored bytes (active experts' share)
    attn_width: int  # heads x head_dim: one query position's QK^T (and PV) per key
    kv_width: int  # 2 x KV heads x head_dim: the K and V elements a layer caches a token
    windows: tuple[int, ...]  # per layer, 0 = full attention, else the window in tokens

    @classmethod
    def from_gguf(cls, path: Path) -> ModelCost:
        import gguf
        from actorlm.gpu.gguf_file import GGUFFile
        from actorlm.gpu.model_info import load_model_info

        info = load_model_info(path)
        f = GGUFFile(path)
        active = info.num_experts_per_tok / info.num_experts if info.num_experts else 1.0

        def stored(t: Any) -> int:  # a tensor's bytes in its GGUF blocks
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.qtype)]
            return math.prod(t.shape) // block * size

        params = nbytes = head = 0
        for name, t in f.tensors.items():
            if len(t.shape) < 2 or not (name.startswith("blk.") or name == "output.weight"):
                continue
            share = active if len(t.shape) == 3 else 1.0  # [experts, rows, cols]
            if name == "output.weight":
                head, nbytes = math.prod(t.shape), nbytes + stored(t)
            else:
                params += int(math.prod(t.shape) * share)
                nbytes += int(stored(t) * share)
        if not head:  # tied: the head is the embedding matrix
            t = f.tensors["token_embd.weight"]
            head, nbytes = math.prod(t.shape), nbytes + stored(t)
        L = info.num_layers
        return cls(
            linear_params=params,
            head_params=head,
            weight_bytes=nbytes,
            attn_width=info.num_heads * info.head_dim,
            kv_width=2 * info.num_kv_heads * info.head_dim,
            windows=tuple(info.window(i) for i in range(L)),
        )

    def seen(self, positions: int) -> int:
        """Keys a query at ``positions - 1`` reads over all layers (windows applied)."""
        return sum(min(positions, w) if w else positions for w in self.windows)

    def attn_flops(self, start: int, end: int) -> float:
        """Causal attention of the queries at positions [start, end)."""
        if self.windows and all(w == 0 for w in self.windows):  # closed form
            span = (end * (end + 1) - start * (start + 1)) // 2
            return 4.0 * self.attn_width * len(self.windows) * span
        return 4.0 * self.attn_width * sum(self.seen(p + 1) for p in range(start, end))


def prefix_split(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """For each prompt, in order: the tokens no earlier prompt starts with (what a
    perfect prefix cache still computes), and the tokens no other prompt shares."""
    root: dict[int, Any] = {}
    counts: dict[int, int] = {}
    paths: list[list[int]] = []
    new: list[int] = []
    for ids in prompts:
        node, path, fresh = root, [], 0
        for tok in ids:
            if tok not in node:
                node[tok] = {}
                fresh += 1
            node = node[tok]
            path.append(id(node))
            counts[id(node)] = counts.get(id(node), 0) + 1
        paths.append(path)
        new.append(fresh)
    own = [sum(1 for n in path if counts[n] == 1) for path in paths]
    return new, own


def level_floor(
    cost: ModelCost,
    bandwidth: float,
    gemm: float,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[int],
    concurrency: int | None,
) -> dict[str, float]:
    """The floor of one level (module docstring): seconds, the FLOPs and bytes behind
    them, the ceiling in output tokens/s, and the TTFT p50 floor in ms."""
    new, own = prefix_split(prompts)
    lin = 2.0 * cost.linear_params
    head = 2.0 * cost.head_params
    flops = kv_bytes = 0.0
    ttft: list[float] = []
    for ids, fresh, mine, out in zip(prompts, new, own, outputs, strict=True):
        p = len(ids)
        prefill = lin * fresh + cost.attn_flops(p - fresh, p) + head
        cached = cost.seen(p - fresh) * cost.kv_width * KV_BYTES
        ttft.append(max(prefill / gemm, (cost.weight_bytes + cached) / bandwidth))
        steps = max(0, out - 1)  # the first token comes from the prefill
        flops += prefill + (lin + head) * steps + cost.attn_flops(p, p + steps)
        # decode token j reads its own request's tokens: `mine` of the prompt and j of its own
        own_keys = sum(cost.seen(mine + j) for j in range(1, steps + 1))
        kv_bytes += own_keys * cost.kv_width * KV_BYTES
    decoded = sum(max(0, o - 1) for o in outputs)
    steps = max(1, math.ceil(decoded / max(1, concurrency or len(outputs))))
    weight_bytes = steps * float(cost.weight_bytes)
    nbytes = weight_bytes + kv_bytes
    floor_s = max(flops / gemm, nbytes / bandwidth)
    return {
        "floor_s": floor_s,
        "compute_s": flops / gemm,
        "memory_s": nbytes / bandwidth,
        "flops": flops,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "decode_steps": steps,
        "ceiling_out_tok_s": sum(outputs) / floor_s,
        "ttft_p50_floor_ms": statistics.median(ttft) * 1e3 if ttft else 0.0,
    }


def measure_limits() -> dict[str, float]:
    """The machine's read bandwidth (bytes/s) and best GEMM (FLOP/s, the best of every
    dtype ``bench/machine.py`` measures), in a child process: the benchmark's own
    process stays free of torch while engines run beside it."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "machine.py"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=600
    )
    m = json.loads(out.stdout)
    gemms = {k: v * 1e9 for k, v in m.items() if k.startswith("gemm_") and k.endswith("_gflops")}
    return {"read_bandwidth": m["read_bandwidth_gbs"] * 1e9, "gemm": max(gemms.values()), **gemms}
