"""Ctrl-C while the actors are still starting: the server exits promptly, no orphans.

Its own ``actorlm serve`` (the package's shared server is not touched).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from actorlm.actors.runtime.transport import free_port

from .conftest import _status, alive, child_pids

pytestmark = pytest.mark.timeout(180)


def test_sigint_during_startup_exits_without_orphans(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "actorlm.cli", "serve",
        "--model", str(tiny_llama), "--port", str(port), "--kv-cache-gb", "0.05",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    kids: set[int] = set()
    try:
        # Loading: the gateway answers 503 and the actor processes exist, none ready yet.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            kids = child_pids(proc.pid)
            if _status(f"http://127.0.0.1:{port}/health") == 503 and len(kids) >= 4:
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        else:
            pytest.fail(f"never saw the loading state:\n{log.read_text()}")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"actorlm serve hung after SIGINT during start-up:\n{log.read_text()}")
        text = log.read_text()
        assert "actorlm: stopped" in text
        assert "never retrieved" not in text and "Traceback" not in text, text
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in kids if alive(pid)], "actor processes outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
