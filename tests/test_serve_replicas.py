"""``actorlm serve --dp-size 2``: one process per actor, two replicas. Killing one
replica's worker mid-stream ends that replica's stream alone, at once and with a clear
error; the other replica's stream runs to its end, the supervisor restarts the dead
worker by itself, and both replicas serve again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, http
from tests.test_serve import Served, role_pids

pytestmark = pytest.mark.timeout(300)

ROLES = {"gateway", "tokenizer", "scheduler", "cache_manager", "worker"}
ROLES |= {"scheduler.1", "cache_manager.1", "worker.1"}


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve-dp") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", "--dp-size", "2"]
    cmd += ["--router-policy", "least_load"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy()
        s.baseline = s.greedy()
        yield s
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tokenizer_stat(served: Served, key: str) -> list[int]:
    deadline = time.monotonic() + 30
    while True:  # a stats read can time out (5 s) on a busy 2-core machine: ask again
        status, info = http(f"{served.url}/get_server_info")
        assert status == 200, info
        tokenizer = info["stats"]["tokenizer"]
        if key in tokenizer:
            return list(tokenizer[key])
        assert time.monotonic() < deadline, tokenizer


def loads(served: Served) -> list[int]:
    return tokenizer_stat(served, "router_load")


def test_a_killed_worker_fails_only_its_replicas_requests(served: Served) -> None:
    before = role_pids(served.proc.pid)
    assert set(before) == ROLES
    # least_load: the first stream goes to one replica, the second to the other
    first = Stream(served.url, max_tokens=800, stream_options={"include_usage": True})
    first.start()
    assert first.first.wait(30) and not first.ended, first.events
    on = loads(served).index(1)
    second = Stream(served.url, max_tokens=2000)
    second.start()
    assert second.first.wait(30) and not second.ended, second.events
    assert loads(served) == [1, 1]
    victim = "worker.1" if on == 0 else "worker"
    os.kill(before[victim], signal.SIGKILL)
    killed = time.monotonic()
    second.join(30)
    assert second.ended and second.ended - killed < 1.5, second.events[-3:]
    assert second.failed_cleanly, second.events[-3:]
    assert not first.ended  # still streaming...
    first.join(120)
    assert first.events[-1] == "[DONE]" and not first.failed_cleanly  # ...to its end
    last = json.loads(first.events[-2])
    assert json.loads(first.events[-3])["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 800

    served.wait_healthy()
    deadline = time.monotonic() + 60
    while (after := role_pids(served.proc.pid)).get(victim) in (None, before[victim]):
        assert time.monotonic() < deadline, served.log_tail()
        time.sleep(0.1)
    assert {r: after[r] for r in ROLES - {victim}} == {r: before[r] for r in ROLES - {victim}}
    deadline = time.monotonic() + 30  # the router takes the replica back once it is up
    while not _both_serve(served):
        assert time.monotonic() < deadline, served.log_tail()
        time.sleep(0.2)


def routed(served: Served) -> list[int]:
    return tokenizer_stat(served, "router_routed")


def _both_serve(served: Served) -> bool:
    """Two requests at once: least_load gives each replica one; both give the baseline."""
    before = routed(served)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: served.greedy(), range(2)))
    after = routed(served)
    assert outs == [served.baseline] * 2
    return all(a > b for a, b in zip(after, before, strict=True))
