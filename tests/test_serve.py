"""``actorlm serve`` under faults: each process, the gateway included, killed with
SIGKILL while a request streams. The stream ends promptly with a clear error (or, for
the gateway, its connection closes), the supervisor brings the process back by itself
while the others keep running, and serving resumes with the tokens it gave before,
from a KV pool that is whole (issues 17 and 26)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, get_text, http, stop

pytestmark = pytest.mark.timeout(600)

PROMPT = list(range(400, 440))
# The greedy tokens these tests compare come cold and from a cached prefix, whose new
# tokens run other kernels than the whole prompt did (the fused step against the
# forward): in bf16 a random tiny model's greedy path can part there on a near tie (token
# 8 of 12 on a Zen 4), so the restarts are judged in fp32.
EXACT = ["--dtype", "float32"]


def role_pids(parent: int) -> dict[str, int]:
    """The actor processes of a server: ``python -m actorlm.actors.runtime.child ROLE``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == parent and b"actorlm.actors.runtime.child" in argv:
            out[argv[argv.index(b"actorlm.actors.runtime.child") + 1].decode()] = int(entry.name)
    return out


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    baseline: list[int] = field(default_factory=list)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while http(f"{self.url}/health")[0] != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log_tail()
            time.sleep(0.1)

    def greedy(self) -> list[int]:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        status, out = http(f"{self.url}/generate", {**body})
        assert status == 200, out
        return list(out["output_ids"])

    def cache_stats(self) -> dict[str, Any]:
        status, info = http(f"{self.url}/get_server_info")
        assert status == 200, info
        return dict(info["stats"]["cache_manager"])

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", *EXACT]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy()
        s.baseline = s.greedy()
        yield s
    finally:
        stop(proc)


@pytest.mark.parametrize("role", ["worker", "cache_manager", "scheduler", "tokenizer", "gateway"])
def test_a_killed_process_comes_back_by_itself(served: Served, role: str) -> None:
    assert served.greedy() == served.baseline  # its prefix is cached now
    before = role_pids(served.proc.pid)
    assert set(before) == {"gateway", "tokenizer", "scheduler", "cache_manager", "worker"}
    stream = Stream(served.url)
    stream.start()
    assert stream.first.wait(30) and not stream.ended, stream.events
    os.kill(before[role], signal.SIGKILL)
    killed = time.monotonic()
    stream.join(30)
    assert stream.ended and stream.ended - killed < 1.5, stream.events[-3:]
    if role == "gateway":
        assert stream.events[-1].startswith("closed") or not stream.failed_cleanly
    else:
        assert stream.failed_cleanly, stream.events[-3:]
    served.wait_healthy()
    after = role_pids(served.proc.pid)
    assert after[role] != before[role]  # restarted...
    others = {r: p for r, p in before.items() if r != role}
    assert {r: after[r] for r in others} == others  # ...while the rest kept running
    assert served.greedy() == served.baseline
    deadline = time.monotonic() + 10  # the aborted stream's pages come back
    while (stats := served.cache_stats())["running_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["consistent"] and stats["running_requests"] == 0 and stats["pages_private"] == 0
    status, flushed = http(f"{served.url}/flush_cache", {})
    assert status == 200, flushed  # no page is left owned by a request that died
    if role != "gateway":  # a new gateway has not seen the death
        status, metrics = get_text(f"{served.url}/metrics")
        assert status == 200 and f'actorlm_actor_restarts_total{{role="{role}"}}' in metrics
