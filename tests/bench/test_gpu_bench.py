"""bench/gpu.py: its help and its refusal without CUDA from the command line, the bounds
it reports beside each decode step, and its random-weights model folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from actorlm.gpu.model_info import hf_model_info
from actorlm.gpu.platforms import estimate_weight_bytes

from bench.gpu import bounds, markdown
from bench.random_weights import LLAMA3_8B, SMOKE, write_model

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu.py"


def test_help_runs_anywhere() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "Llama-3-8B" in out.stdout and "--smoke" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_refuses_without_cuda_in_one_line() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "bench/gpu.py: needs a CUDA device (torch.cuda.is_available() is False); "
        "--smoke checks the script on this machine"
    ]


def test_bounds_of_a_llama3_8b_decode_step(tmp_path: Path) -> None:
    info = hf_model_info(write_model(tmp_path / "m", LLAMA3_8B))
    params = 8_030_261_248  # Llama-3-8B's parameter count
    assert estimate_weight_bytes(info, "bfloat16") == 2 * params
    lim = {"copy_bandwidth_gbs": 4000.0, "matmul_tflops": 800.0}
    one = bounds(info, params, 2 * params, 1, 1024, lim)
    # 16.06 GB of weights and 1024 tokens x 128 KiB of K/V at 4 TB/s
    assert one["bandwidth_bound_ms"] == pytest.approx((2 * params + 1024 * 131072) / 4e9)
    big = bounds(info, params, 2 * params, 256, 1024, lim)
    embed = 128256 * 4096
    assert big["flops"] == 2 * (params - embed) * 256 + 4 * 256 * 1024 * 32 * 32 * 128
    assert big["compute_bound_ms"] == pytest.approx(big["flops"] / 8e11)
    # at batch 256 the K/V (32 GiB) outweighs the weights: the bandwidth bound is higher
    assert big["bandwidth_bound_ms"] > big["compute_bound_ms"]


def test_table_names_device_versions_and_targets() -> None:
    row = {
        "batch": 1, "step_ms": 5.0, "replay_ms": 4.5, "tokens_per_s": 200.0, "bandwidth_bound_ms": 4.0,
        "compute_bound_ms": 0.1, "over_bandwidth_bound": 1.25, "share_of_matmul": 0.02,
    }  # fmt: skip
    results = {
        "machine": {"device": "H200", "capability": "9.0", "torch": "2.13", "cuda": "12.8",
                    "triton": "3.9.0", "flashinfer": "0.7.2", "cpu_model": "Xeon"},
        "limits": {"copy_bandwidth_gbs": 4000.0, "matmul_tflops": 800.0},
        "decode": {"triton": [row]},
        "offline": {"triton": {"requests": 256, "output_tokens_per_s": 9000.0,
                               "total_tokens_per_s": 45000.0, "total_s": 7.3}},
    }  # fmt: skip
    table = markdown(results)
    assert "H200 (sm 9.0)" in table and "triton 3.9.0, flashinfer 0.7.2" in table
    assert "| triton | 1 | 5.00 | 4.50 | 200 | 4.00 | 1.25x | 0.10 | 2% |" in table
    results["decode"]["triton"] = [{**row, "replay_ms": None}]  # eager steps: no graph
    assert "| triton | 1 | 5.00 | - | 200 |" in markdown(results)
    assert "| triton | 256 | 9000 | 45000 | 7.3 |" in table
    assert "within 1.3x" in table


def test_random_model_folder(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = write_model(tmp_path / "m", SMOKE)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == SMOKE["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = [5, 17, SMOKE["vocab_size"] - 1]
    assert tok.decode(ids) == f"t5 t17 t{SMOKE['vocab_size'] - 1}"
    assert tok("t5 t17", add_special_tokens=False).input_ids == [5, 17]
