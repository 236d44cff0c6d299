"""bench/disagg.py's arithmetic (cache hit rate over replicas, the table); no live engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.disagg import cache_counts, concurrency, hit_rate, parse_args, table
from bench.serving_metrics import RequestResult, summarize

ROOT = Path(__file__).parents[2]


def test_the_hit_rate_sums_every_replica_and_counts_only_the_run() -> None:
    stats = {
        "tokenizer": {"prefix_matched_tokens": 999},
        "cache_manager": {"prefix_matched_tokens": 100, "prefix_requested_tokens": 300},
        "cache_manager.1": {"prefix_matched_tokens": 50, "prefix_requested_tokens": 100},
    }
    assert cache_counts(stats) == (150, 400)
    assert hit_rate((50, 200), (150, 400)) == 0.5
    assert hit_rate((1, 1), (1, 1)) == 0.0


def test_the_table_compares_each_workload_with_its_first_setup() -> None:
    def row(name: str, replicas: int, tokens: int) -> dict[str, object]:
        r = RequestResult(10, tokens, ok=True, start=0.0, end=1.0, ttft=0.1, itl=[0.01] * 3)
        r.output_tokens = tokens
        return {
            "setup": name,
            "replicas": replicas,
            "policy": "-",
            "worker_cpus": [str(i) for i in range(replicas)],
            "concurrency": 8 * replicas,
            "hit_rate": 0.25,
            "summary": summarize([r], 1.0),
        }

    pd = {**row("pd", 1, 120), "workload": "long", "prefill_replicas": 1}
    pd["worker_cpus"] = ["0", "1"]
    pd["cpu_s"] = {"worker": 2.0, "worker.1": 3.5, "tokenizer": 1.25, "serve": 0.25}
    rows = [row("one", 1, 100), row("cache_aware", 2, 190), row("colocated", 2, 100), pd]
    rows[2]["workload"] = "long"
    text = table(rows)
    assert "| shared | one | 1 (0) | - | c=8 | 1.00 | 100.0 | 1.00 |" in text
    assert text.count("| - |\n") == 3  # no CPU times recorded
    assert "| shared | cache_aware | 2 (0,1) | - | c=16 | 1.00 | 190.0 | 1.90 |" in text
    assert "| long | pd | 1+1P (0,1) | - | c=8 | 1.00 | 120.0 | 1.20 |" in text  # x colocated
    assert "| 5.5 / 1.5 |" in text
    assert "25.0%" in text


def test_per_replica_scales_the_load_by_decode_replicas() -> None:
    assert concurrency(parse_args(["--concurrency", "8"]), 2) == 8
    assert concurrency(parse_args(["--concurrency", "8", "--per-replica"]), 2) == 16
    assert concurrency(parse_args(["--concurrency", "8", "--per-replica"]), 1) == 8
    assert parse_args(["--confine"]).confine and not parse_args([]).confine


def test_help_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "disagg.py"), "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "--cpus" in done.stdout
