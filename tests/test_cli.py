"""The ``actorlm`` command on a user's mistakes: one clear line and a non-zero exit,
never a traceback (issue 17); and ``actorlm keys``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def actorlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actorlm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("actorlm: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--eviction-policy", "nope"], "unknown KV eviction policy 'nope'"),
        (["serve", "--attention-backend", "nope"], "unknown attention backend 'nope'"),
        (["serve", "--schedule-policy", "nope"], "choose one of fcfs, lpm, priority"),
        (["serve", "--restart-policy", "sometimes"], "choose one of on-failure, never"),
        (["serve", "--transport", "inproc"], "joins actors inside one process"),
        (["serve", "--model", "/no/such/model"], "model not found: /no/such/model"),
        (["serve", "--hicache-storage-backend", "file"], "needs --hicache-storage-dir"),
        (["serve", "--grammar-backend", "nope"], "unknown grammar backend 'nope'"),
        (["serve", "--reasoning-parser", "nope"], "unknown reasoning parser 'nope'"),
        (["serve", "--router-policy", "nope"], "unknown router policy 'nope'"),
        (["serve", "--dp-size", "0"], "--dp-size 0 is out of range"),
        (["serve", "--dp-size", "2", "--worker-cpus", "0"], "give one per replica"),
        (["serve", "--dp-size", "2", "--worker-cpus", "0", "x"], "bad CPU list 'x'"),
        (["serve", "--dp-size", "2", "--enable-lora"], "does not serve LoRA adapters yet"),
        (["serve", "--prefill-replicas", "-1"], "--prefill-replicas, --max-local"),
        (["serve", "--prefill-replicas", "1", "--worker-cpus", "0"], "(--dp-size plus"),
        (["serve", "--prefill-replicas", "1", "--kv-transfer-timeout-s", "0"], "must be > 0"),
        (["serve", "--router-balance-rel", "0.5"], "must be >= 1"),
        (["actor", "worker"], "give --deploy FILE"),
        (["actor", "worker", "--bind", "tcp://0.0.0.0:1"], "refusing to bind tcp://0.0.0.0:1"),
    ],
)
def test_a_bad_setting_is_one_line(args: list[str], needle: str) -> None:
    assert needle in one_error(actorlm(*args))


def test_bad_deployment_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npath = 1")
    assert "is not valid TOML" in one_error(actorlm("serve", "--deploy", str(bad)))
    bad.write_text("[modell]\npath = 'x'\n")
    assert "unknown section [modell]" in one_error(actorlm("serve", "--deploy", str(bad)))
    bad.write_text("[model]\npage_size = 'big'\n")
    assert "[model]" in one_error(actorlm("serve", "--deploy", str(bad)))
    bad.write_text("[actors.worker]\nbind = 'tcp://127.0.0.1:1'\n")
    assert "needs an address" in one_error(actorlm("actor", "worker", "--deploy", str(bad)))
    missing = tmp_path / "missing.toml"
    assert "cannot read the deployment file" in one_error(
        actorlm("serve", "--deploy", str(missing))
    )


def test_a_deployment_file_places_replicas(tmp_path: Path) -> None:
    from actorlm.launch import load_deployment

    path = tmp_path / "dp.toml"
    path.write_text(
        "[router]\ndp_size = 2\nrouter_policy = 'round_robin'\n"
        "[deploy]\nworker_cpus = ['0', '1']\n"
        "[actors.scheduler]\naddress = 'tcp://127.0.0.1:7001'\n"
        "[actors.scheduler.1]\naddress = 'tcp://127.0.0.1:7002'\n"
        "[actors.worker.1]\naddress = 'tcp://127.0.0.1:7003'\nbind = 'tcp://127.0.0.1:7004'\n"
    )
    dep = load_deployment(path)
    assert dep.config.router.dp_size == 2 and dep.config.router.router_policy == "round_robin"
    assert dep.config.deploy.worker_cpus == ["0", "1"]
    assert dep.addresses == {
        "scheduler": "tcp://127.0.0.1:7001",
        "scheduler.1": "tcp://127.0.0.1:7002",
        "worker.1": "tcp://127.0.0.1:7003",
    }
    assert dep.binds["worker.1"] == "tcp://127.0.0.1:7004"


def test_an_unknown_platform_fails_plugins_and_serve() -> None:
    env = {"ACTORLM_PLATFORM": "no-such-platform"}
    listed = actorlm("plugins", env=env)
    assert "no-such-platform" in one_error(listed)
    assert "Registries:" in listed.stdout  # the rest of the report is still printed
    assert "no-such-platform" in one_error(actorlm("serve", env=env))


def test_keys_are_created_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    proc = actorlm("keys", str(folder), "--roles", "worker,client")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == [
        "client.key",
        "client.key_secret",
        "worker.key",
        "worker.key_secret",
    ]
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "worker.key_secret").stat().st_mode & 0o777 == 0o600
    again = actorlm("keys", str(folder), "--roles", "worker")
    assert again.returncode == 0 and "0 key pair(s)" in again.stdout  # existing pairs stay
    replicas = actorlm("keys", str(folder), "--roles", "worker", "--dp-size", "3")
    assert replicas.returncode == 0 and "6 key pair(s)" in replicas.stdout, replicas.stdout
    made = {p.name for p in folder.glob("*.key")}
    assert {f"{r}.{i}.key" for r in ("scheduler", "cache_manager", "worker") for i in (1, 2)} < made
    prefill = actorlm("keys", str(folder), "--dp-size", "3", "--prefill-replicas", "1")
    assert prefill.returncode == 0, prefill.stderr
    assert "worker.3.key" in {p.name for p in folder.glob("*.key")}  # the prefill replica's


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_a_cuda_backend_on_a_cpu_machine_is_one_line(backend: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    line = one_error(actorlm("serve", "--attention-backend", backend))
    assert f"attention backend '{backend}' runs on CUDA devices only" in line


def test_structured_output_flags() -> None:
    from actorlm.cli import _options, build_parser
    from actorlm.launch import config_from_options, validate_config

    args = build_parser().parse_args(
        ["serve", "--grammar-backend", "llguidance", "--grammar-fallback", "none",
         "--grammar-compile-timeout", "2.5", "--reasoning-parser", "qwen3"]
    )  # fmt: skip
    config = config_from_options(**_options(args))
    validate_config(config)
    g = config.grammar
    assert (g.grammar_backend, g.grammar_fallback) == ("llguidance", "none")
    assert (g.grammar_compile_timeout_s, g.reasoning_parser) == (2.5, "qwen3")
