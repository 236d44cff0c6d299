"""The serving benchmark's machine ceiling: the work a level's requests hold, counted by
hand on small cases, and the model's costs read from the default GGUF against what
transformers and the gguf library say of the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.serving_bound import ModelCost, level_floor, prefix_split
from bench.serving_report import ceiling_table


def test_prefix_split_counts_what_a_perfect_prefix_cache_computes_and_what_is_shared() -> None:
    new, own = prefix_split([[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [1, 2, 3, 4]])
    assert new == [4, 2, 2, 0]  # the last is a repeat: nothing left to compute
    assert own == [0, 2, 2, 0]  # 1 2 3 4 is held by two requests, 1 2 3 by three


def one_layer(windows: tuple[int, ...] = (0,)) -> ModelCost:
    return ModelCost(
        linear_params=100,
        head_params=10,
        weight_bytes=1000,
        attn_width=2,
        kv_width=4,
        windows=windows,
    )


def test_level_floor_by_hand() -> None:
    cost = one_layer()
    f = level_floor(cost, 1000.0, 1000.0, [[1, 2, 3], [1, 2, 9]], [3, 2], concurrency=2)
    # request 0: 3 new tokens, 2 decoded; request 1: 1 new token (1 2 cached), 1 decoded
    # prefill: 2*100 a token + head 2*10 + causal attention 4*2 * (1 + 2 + 3) / (3)
    p0 = 200 * 3 + 4 * 2 * (1 + 2 + 3) + 20
    p1 = 200 * 1 + 4 * 2 * 3 + 20
    d0 = 2 * (200 + 20) + 4 * 2 * (4 + 5)
    d1 = 1 * (200 + 20) + 4 * 2 * 4
    assert f["flops"] == p0 + d0 + p1 + d1
    # decode token j of a request reads its own prompt tokens (1 each: the third) and j
    assert f["kv_bytes"] == ((1 + 1) + (1 + 2) + (1 + 1)) * 4 * 2
    assert f["decode_steps"] == 2  # 3 decoded tokens, 2 rows a step
    assert f["weight_bytes"] == 2 * 1000
    assert f["floor_s"] == pytest.approx(max(f["flops"], 2000 + f["kv_bytes"]) / 1000)
    assert f["ceiling_out_tok_s"] == pytest.approx(5 / f["floor_s"])
    # alone: request 0 reads the weights (1 s), request 1 also its 2 cached tokens' K and V
    assert f["ttft_p50_floor_ms"] == pytest.approx((1000 + (1000 + 2 * 4 * 2) / 1000 * 1000) / 2)


def test_one_row_a_step_when_alone_and_windows_cap_what_a_query_reads() -> None:
    f = level_floor(one_layer(), 1e9, 1e12, [[1, 2]], [5], concurrency=1)
    assert f["decode_steps"] == 4
    windowed = one_layer((0, 2))
    assert windowed.seen(5) == 5 + 2
    assert windowed.attn_flops(0, 3) == 4 * 2 * ((1 + 2 + 3) + (1 + 2 + 2))
    full = one_layer((0, 0))
    assert full.attn_flops(2, 6) == 4 * 2 * 2 * (3 + 4 + 5 + 6)  # the closed form


def test_costs_of_the_default_gguf(default_gguf: Path, default_gguf_transformers: Any) -> None:
    import gguf
    from torch import nn

    cost = ModelCost.from_gguf(default_gguf)
    model = default_gguf_transformers
    layers = model.model.layers
    linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    assert cost.linear_params == sum(m.weight.numel() for m in linears)
    assert cost.head_params == model.lm_head.weight.numel()  # tied to the embeddings
    reader = gguf.GGUFReader(default_gguf)
    stored = {t.name: int(t.n_bytes) for t in reader.tensors if len(t.shape) >= 2}
    assert cost.weight_bytes == sum(stored.values())  # the layers' blocks and the head's
    cfg = model.config
    assert cost.attn_width == cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert cost.windows == (0,) * cfg.num_hidden_layers


def test_ceiling_table_puts_each_engine_against_the_floor() -> None:
    summary = {"output_throughput": 250.0, "ttft_ms": {"p50": 90.0}}
    data = {
        "limits": {"read_bandwidth": 25e9, "gemm": 2e12},
        "ceiling": [
            {
                "concurrency": 8,
                "request_rate": None,
                "ceiling_out_tok_s": 1000.0,
                "compute_s": 0.5,
                "memory_s": 1.0,
                "ttft_p50_floor_ms": 30.0,
            }
        ],
        "engines": {"actorlm": {"label": "actorlm auto", "levels": [{"summary": summary}]}},
    }
    table = ceiling_table(data)
    assert "read 25.0 GB/s, best GEMM 2,000 GFLOP/s" in table
    assert "| c=8 | 1,000.0 | 0.50 / 1.00 | 30.0 | 25%, 3.00× |" in table
