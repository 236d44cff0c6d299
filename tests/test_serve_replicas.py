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
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from actorlm.actors.replicas import replica_members
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, http, stop
from tests.test_serve import EXACT, PROMPT, Served, role_pids

pytestmark = pytest.mark.timeout(300)

ROLES = {"gateway", "tokenizer", "scheduler", "cache_manager", "worker"}
ROLES |= {"scheduler.1", "cache_manager.1", "worker.1"}


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve-dp") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", "--dp-size", "2", *EXACT]
    cmd += ["--router-policy", "least_load"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy()
        s.baseline = s.greedy()
        yield s
    finally:
        stop(proc)


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


def test_a_drained_replica_restarts_while_the_other_serves_and_no_request_fails(
    served: Served,
) -> None:
    served.wait_healthy()
    before = role_pids(served.proc.pid)
    # a stream on replica 1 when the drain starts: it runs to its end first
    _both_serve(served)
    running = Stream(served.url, max_tokens=300, stream_options={"include_usage": True})
    running.start()
    assert running.first.wait(30) and not running.ended, running.events
    target = loads(served).index(1)  # drain the replica holding the stream
    outs: list[tuple[int, Any]] = []
    stop = threading.Event()

    def traffic() -> None:  # a client that keeps asking all along
        while not stop.is_set():
            outs.append(http(f"{served.url}/generate", GREEDY_BODY))

    clients = [threading.Thread(target=traffic) for _ in range(2)]
    for t in clients:
        t.start()
    # the stream may take longer than --shutdown-timeout (5 s) beside the traffic on 2 cores
    status, body = http(f"{served.url}/drain_replica", {"replica": target, "timeout": 40})
    after_restart = len(outs)
    time.sleep(1.0)  # traffic goes on with the replica back
    stop.set()
    for t in clients:
        t.join(60)
    assert status == 200 and body["drained"] and body["restarted"], body
    assert body["in_flight"] == 0
    running.join(60)  # finished before the restart, whole
    chunks = [json.loads(e) for e in running.events if e.startswith("{")]
    assert chunks[-1]["usage"]["completion_tokens"] == 300 and running.events[-1] == "[DONE]"
    assert outs and all(s == 200 for s, _ in outs), [o for o in outs if o[0] != 200][:3]
    # (bf16: batched with each other, or over a cached prefix, the tokens may drift from the
    # baseline; both replicas give it exactly once back, below)
    assert all(len(o["output_ids"]) == 12 for _, o in outs)
    assert after_restart > 0  # requests were served while it drained and restarted
    victims = set(replica_members(target))
    after = role_pids(served.proc.pid)
    assert all(after[r] != before[r] for r in victims), (before, after)
    assert all(after[r] == before[r] for r in ROLES - victims)
    deadline = time.monotonic() + 30  # and the router sends it requests again
    while not _both_serve(served):
        assert time.monotonic() < deadline, served.log_tail()
        time.sleep(0.2)
    status, body = http(f"{served.url}/drain_replica", {"replica": 5})
    assert status == 400 and "'replica'" in body["error"]["message"], body
    status, body = http(f"{served.url}/drain_replica", {"replica": 0, "timeout": -1})
    assert status == 400 and body["error"]["param"] == "timeout", body


GREEDY_BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
