"""One real ``actorlm serve`` process shared by every gateway test (startup costs seconds),
and ``running_server`` for tests that serve a model of their own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from actorlm.actors.runtime.transport import free_port

API_KEY = "test-key"
MAX_QUEUED = 4  # small, so one request with n > 4 proves the 429 path
STARTUP_TIMEOUT_S = 240


def child_pids(pid: int) -> set[int]:
    """Every descendant of ``pid`` (read from /proc, so no extra package is needed)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    model: str
    log: Path
    seen_loading: bool = False  # /health answered 503 before 200

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@contextlib.contextmanager
def running_server(model: Path, log: Path, *args: str) -> Iterator[Server]:
    """``actorlm serve --model MODEL ARGS...`` on a free port, healthy, stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(model), "--port", str(port),
           "--api-key", API_KEY, "--kv-cache-gb", "0.05", *args]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    srv = Server(proc, f"http://127.0.0.1:{port}", model.name, log)
    health = f"{srv.url}/health"
    seen_503 = False
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            code = _status(health)
            seen_503 |= code == 503
            if code == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"actorlm serve did not become healthy (exit {proc.poll()}):\n{srv.log_text()[-4000:]}"
                )
            time.sleep(0.2)
        srv.seen_loading = seen_503
        yield srv
    finally:
        if proc.poll() is None:
            kids = child_pids(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                for pid in kids:
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="package")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ("--max-queued-requests", str(MAX_QUEUED), "--drain-timeout-s", "10")
    with running_server(tiny_llama, log, *args) as srv:
        yield srv


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``stops_shared_server`` run after every other gateway test: they stop
    the package's shared ``server`` (file order would put test_structured_output.py and
    test_tools.py after test_shutdown.py)."""
    last = [item for item in items if item.get_closest_marker("stops_shared_server")]
    if not last:
        return
    rest = [item for item in items if item not in last]
    gateway = [k for k, item in enumerate(rest) if "tests/gateway/" in item.nodeid]
    at = gateway[-1] + 1 if gateway else len(rest)
    items[:] = rest[:at] + last + rest[at:]
