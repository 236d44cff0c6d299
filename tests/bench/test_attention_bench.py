"""bench/attention.py: the bytes a decode step's attention reads, and a run over a tiny
shape in this CPU's best build, its table's limit column from the same run's bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest
from actorlm.gpu.kernels import native

from bench import attention

KERNEL = native.load(Path(attention.__file__).parents[1] / "gpu" / "kernels" / "cpu_step.c")


def test_a_step_reads_every_layers_k_and_v_once() -> None:
    # the default model's shape: 32 sequences over 300 tokens, 30 layers, 3 KV heads of 64
    shape = attention.Shape(32, 300, 9, 3, 64, 30, 16, "bfloat16")
    assert attention.kv_bytes(shape) == 2 * 30 * 32 * 300 * 3 * 64 * 2
    fp32 = attention.Shape(1, 10, 4, 2, 8, 1, 16, "float32")
    assert attention.kv_bytes(fp32) == 2 * 10 * 2 * 8 * 4
    with pytest.raises(ValueError, match="multiple of --kv-heads"):
        attention.Shape(1, 10, 9, 2, 64, 1, 16, "bfloat16")


def test_pages_come_in_runs_dealt_to_the_sequences_in_turn() -> None:
    assert [attention.page_run(p) for p in ("scattered", "sequential", "runs:8")] == [1, 0, 8]
    for bad in ("runs:0", "runs", "blocks:4"):
        with pytest.raises(ValueError, match="scattered, sequential or runs:N"):
            attention.page_run(bad)
    shape = attention.Shape(3, 100, 9, 3, 64, 1, 16, "bfloat16")  # 7 pages a sequence
    for run in (0, 1, 4):
        pools, table = attention._pools(shape, run, seed=0)
        assert table.shape == (3, 7) and len(set(table.flatten().tolist())) == 21
        assert pools[0].shape[2] == int(table.max()) + 1
        if run:  # each sequence's pages: runs of `run` consecutive ids, then the last cut
            for row in table.tolist():
                starts = row[::run]
                assert all(row[i] == starts[i // run] + i % run for i in range(7)), row
    assert table[0].tolist()[:4] != table[1].tolist()[:4]
    assert attention._pools(shape, 0, seed=0)[1][1].tolist() == list(range(7, 14))


@pytest.mark.skipif(KERNEL is None, reason="needs a C compiler for the kernel")
def test_runs_a_tiny_shape_and_prints_its_limits(tmp_path: Path) -> None:
    best = native.best_isa().name
    out = tmp_path / "attention.json"
    shape = ["--batch-sizes", "2", "--context-lens", "40", "--layers", "2"]
    results = attention.main(
        [*shape, "--steps", "2", "--flush-mb", "1", "--isas", best, "--out", str(out)]
    )
    (run,) = results["runs"]
    assert (run["isa"], run["batch"], run["context"]) == (best, 2, 40)
    assert run["bytes"] == 2 * 2 * 2 * 40 * 3 * 64 * 2
    assert run["ms"] > 0 and run["hot_ms"] > 0 and results["read_bandwidth"] > 0
    limit = run["bytes"] / results["read_bandwidth"] * 1e3
    md = out.with_suffix(".md").read_text()
    assert f"| {best} | bfloat16 | 2 | 40 | 0.1 | " in md and f"| {limit:.2f} |" in md
