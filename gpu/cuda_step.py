"""What a step on a CUDA device adds to the runner: the step's inputs reach the device
through pinned memory in one non-blocking copy, and the KV pool is checked against the
memory really free once the weights are in (the pool was sized from an estimate)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .forward_meta import ForwardMeta
from .model_info import ModelInfo, kv_bytes_per_token

__all__ = ["check_pool_fits", "upload_meta"]


def upload_meta(meta: ForwardMeta, device: torch.device) -> ForwardMeta:
    """``meta`` built on the host → the same with its tensors on ``device``.

    The four index tensors travel as one pinned int64 buffer: a pageable copy makes the
    host wait for the device, four of them four times."""
    parts = (meta.input_ids, meta.positions, meta.out_cache_loc, meta.sample_rows)
    host = torch.cat(parts)
    if device.type == "cuda":
        host = host.pin_memory()
    ids, positions, slots, rows = host.to(device, non_blocking=True).split(
        [p.numel() for p in parts]
    )
    return replace(meta, input_ids=ids, positions=positions, out_cache_loc=slots, sample_rows=rows)


def check_pool_fits(
    device: torch.device, info: ModelInfo, num_pages: int, page_size: int, dtype: str, platform: Any
) -> None:
    """On CUDA, refuse a pool that would not fit, naming the knobs (rather than an
    out-of-memory error from deep inside torch)."""
    if device.type != "cuda":
        return
    need = num_pages * page_size * kv_bytes_per_token(info, dtype)
    free = platform.free_memory(device.index or 0)
    if need > free:
        raise MemoryError(
            f"a KV pool of {num_pages} pages needs {need / 2**30:.2f} GiB, and {free / 2**30:.2f} "
            "GiB are free after the weights; lower --mem-fraction-static, --kv-cache-gb or "
            "--num-pages"
        )
