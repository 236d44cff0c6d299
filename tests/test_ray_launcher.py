"""``actorlm serve --launcher ray``: a two-replica deployment whose pipeline actors run
as Ray actors on a local Ray head this module starts (``ray start --head``), the same
ZMQ messages between them. It answers with the greedy tokens of an in-process engine
on both replicas, a killed worker comes back in a new process under its Ray shell, and
SIGTERM stops everything it started. Skipped, with the reason, where Ray is not
installed; without Ray the flag fails in one line saying how to get it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from actorlm import Engine
from actorlm.actors.runtime.transport import free_port

from tests.servers import http
from tests.test_serve import EXACT, PROMPT, Served

pytestmark = pytest.mark.timeout(300)

_NO_RAY = importlib.util.find_spec("ray") is None
needs_ray = pytest.mark.skipif(_NO_RAY, reason="Ray is not installed (pip install 'actorlm[ray]')")

PIPELINE = {"tokenizer", "scheduler", "cache_manager", "worker"}
PIPELINE |= {"scheduler.1", "cache_manager.1", "worker.1"}


def actor_processes() -> dict[str, tuple[int, str]]:
    """Every ``python -m actorlm.actors.runtime.child ROLE`` here: role → (pid, the
    parent's command line)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if b"actorlm.actors.runtime.child" in argv:
            role = argv[argv.index(b"actorlm.actors.runtime.child") + 1].decode()
            out[role] = (int(entry.name), parent)
    return out


def shells() -> int:
    """Live Ray shells (``ray::_Shell`` processes)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += (entry / "cmdline").read_bytes().startswith(b"ray::_Shell")
    return count


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    ray = Path(sys.executable).with_name("ray")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths are
    cmd = [str(ray), "start", "--head", "--port", str(port), "--num-cpus", "4"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> list[int]:
    with Engine(str(tiny_llama), kv_cache_gb=0.05, dtype="float32") as engine:
        out = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})
    return list(out.token_ids)


@pytest.fixture(scope="module")
def served(
    tiny_llama: Path, ray_head: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve-ray") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", "--dp-size", "2", *EXACT]
    cmd += ["--router-policy", "round_robin", "--launcher", "ray", "--ray-address", ray_head]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy(180)
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@needs_ray
def test_two_replicas_serve_from_ray_actors(served: Served, baseline: list[int]) -> None:
    procs = actor_processes()
    assert set(procs) >= PIPELINE, procs
    for role in PIPELINE:  # each started by its Ray shell, not by the serve process
        assert procs[role][1].startswith("ray::_Shell"), (role, procs[role])
    assert "ray::" not in procs["gateway"][1]  # the gateway stays on this host
    # round_robin: consecutive requests take both replicas
    assert [served.greedy() for _ in range(4)] == [baseline] * 4


@needs_ray
def test_a_killed_worker_comes_back_under_its_shell(served: Served, baseline: list[int]) -> None:
    before = actor_processes()["worker.1"][0]
    os.kill(before, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        now = actor_processes().get("worker.1")
        if now is not None and now[0] != before and http(f"{served.url}/health")[0] == 200:
            break
        assert time.monotonic() < deadline, served.log_tail()
        time.sleep(0.2)
    assert now[1].startswith("ray::_Shell"), now
    assert "worker.1 died" in served.log_tail()
    deadline = time.monotonic() + 60
    while True:  # until the router and the scheduler have the worker back
        try:
            if [served.greedy() for _ in range(2)] == [baseline] * 2:
                break
        except AssertionError:
            pass
        assert time.monotonic() < deadline, served.log_tail()
        time.sleep(0.5)


@needs_ray
def test_sigterm_stops_every_actor_and_shell(served: Served) -> None:
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, served.log_tail()
    deadline = time.monotonic() + 30
    while actor_processes() or shells():
        assert time.monotonic() < deadline, (actor_processes(), shells())
        time.sleep(0.2)


def test_without_ray_the_flag_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from actorlm.config import DeployConfig, EngineConfig
    from actorlm.launch import ConfigError, validate_config

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    config = EngineConfig(deploy=DeployConfig(launcher="ray"))
    with pytest.raises(ConfigError, match=r"pip install 'actorlm\[ray\]'"):
        validate_config(config)
    validate_config(EngineConfig())  # the local launcher needs no Ray
