"""Prefill/decode disaggregation across hosts: a decode replica (tokenizer, scheduler,
cache manager, worker) and a prefill replica (scheduler.1, cache_manager.1, worker.1),
each actor its own process on its own loopback address standing for a host, every
socket authenticated with CurveZMQ keys, and ``actorlm serve --deploy`` in front.

Long prompts are prefilled on the prefill replica and their KV pages shipped over the
tcp transport into the decode worker's pool; the greedy tokens are those of one worker
in one process. A peer without a worker's key ships nothing. A prefill worker killed
with a prompt in flight fails that request alone, promptly; a stream decoding meanwhile
runs to its end, and once the worker is back long prompts go to it again. ``/drain``
with remote prefills in flight loses none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actorlm import Engine
from actorlm.actors.runtime.keys import KEY_ROLES, create_keys
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, http, wait_for_log
from tests.test_serve import Served
from tests.test_split_deployment import PEER_TIMEOUT_S, Split, _raw_push

pytestmark = pytest.mark.timeout(600)

DECODE = ("tokenizer", "scheduler", "cache_manager", "worker")
PREFILL = ("scheduler.1", "cache_manager.1", "worker.1")
HOSTS = {role: f"127.0.0.{i + 2}" for i, role in enumerate(DECODE + PREFILL)}
THRESHOLD = 16
LONG = [(i * 7919) % 30000 + 100 for i in range(200)]  # ~13 pages: prefilled remotely
FRESH = [t + 1 for t in LONG]  # as long, cached nowhere
AGAIN = [t + 2 for t in LONG]
THIRD = [t + 4 for t in LONG]
SHORT = [5, 6, 7, 8, 9]  # prefilled on the decode replica


def write_deployment(path: Path, model: Path, port: int) -> None:
    keys = path.parent / "keys"
    create_keys(keys, (*KEY_ROLES, *PREFILL))
    lines = [
        f'[model]\npath = "{model}"\nkv_cache_gb = 0.05\ndtype = "float32"\n',
        f"[server]\nport = {port}\n",
        f"[router]\nprefill_replicas = 1\nmax_local_prefill_tokens = {THRESHOLD}\n",
        f"[deploy]\npeer_timeout_s = {PEER_TIMEOUT_S}\nheartbeat_s = 0.2\nstart_timeout_s = 90\n"
        f'keys_dir = "{keys}"\n',
    ]
    for role, host in HOSTS.items():
        lines.append(f'[actors.{role}]\naddress = "tcp://{host}:{free_port(host)}"\n')
    path.write_text("\n".join(lines))


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, list[int]]:
    """One worker in one process: the tokens every deployment must give."""
    with Engine(str(tiny_llama), placement="inproc", kv_cache_gb=0.05, dtype="float32") as one:
        params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        return {
            "long": one.generate(LONG, params).token_ids,
            "long_tail": one.generate(LONG[:160] + SHORT * 8, params).token_ids,
            "short": one.generate(SHORT, params).token_ids,
            "fresh": one.generate(FRESH, params).token_ids,
            "again": one.generate(AGAIN, params).token_ids,
            "third": one.generate(THIRD, params).token_ids,
        }


@pytest.fixture(scope="module")
def split(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("pd")
    port = free_port()
    deploy = tmp / "cluster.toml"
    write_deployment(deploy, tiny_llama, port)
    s = Split(deploy, f"http://127.0.0.1:{port}", tmp)
    try:
        for role in DECODE + PREFILL:
            s.start(role)
        s.start("gateway")
        s.wait_healthy(180)
        yield s
    finally:
        s.stop_all()


def stats(split: Split) -> dict[str, Any]:
    status, info = http(f"{split.url}/get_server_info")
    assert status == 200, info
    return dict(info["stats"])


def metric(server: Split | Served, name: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics") as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def test_prefilled_on_one_host_decoded_on_another_gives_one_workers_tokens(
    split: Split, baseline: dict[str, list[int]]
) -> None:
    remote, local = (metric(split, f"actorlm_pd_{k}_prefills") for k in ("remote", "local"))
    assert split.greedy(LONG)[0] == baseline["long"]
    out, cached = split.greedy(LONG[:160] + SHORT * 8)  # a cached prefix, a 40-token tail
    assert out == baseline["long_tail"] and cached == 160
    assert split.greedy(SHORT)[0] == baseline["short"]  # short: computed where it decodes
    assert metric(split, "actorlm_pd_remote_prefills") == remote + 2
    assert metric(split, "actorlm_pd_local_prefills") == local + 1
    got = stats(split)
    assert got["worker.1"]["kv_sent_bytes"] == got["worker"]["kv_received_bytes"] > 0
    assert got["scheduler"]["pd_transfer_failures"] == 0
    for role in ("cache_manager", "cache_manager.1"):  # every page is back on both sides
        assert got[role]["consistent"] and got[role]["pages_private"] == 0, got[role]


def test_a_peer_without_a_workers_key_ships_no_kv(split: Split) -> None:
    import msgspec
    import numpy as np
    from actorlm.launch import load_deployment
    from actorlm.messages.envelope import Envelope, Kind
    from actorlm.messages.kv import KVPages

    address = load_deployment(split.deploy).addresses["worker"]
    keys = split.deploy.parent / "keys"
    before = stats(split)["worker"]

    def pages(sender: str) -> list[bytes]:
        msg = KVPages(rid="x", page_ids=[0], kv=np.zeros(4, np.float32), token_id=1)
        env = Envelope("kv.pages", 1, sender, Kind.SEND)
        return [msgspec.msgpack.encode(env), *_encoded(msg)]

    stranger = _raw_push(address, None, server="worker")  # no key: no handshake
    stranger.send_multipart(pages("worker.1"))
    forger = _raw_push(address, keys, server="worker")  # a client's key, posing as a worker
    forger.send_multipart(pages("worker.1"))
    client = _raw_push(address, keys, server="worker")  # a client, as itself
    client.send_multipart(pages("client-raw"))
    wait_for_log(split.logs / "worker.log", "its key is client's", "taken from workers only")
    for sock in (stranger, forger, client):
        sock.close(linger=0)
    after = stats(split)["worker"]
    assert after["kv_received_bytes"] == before["kv_received_bytes"]
    assert after["kv_dropped"] == before["kv_dropped"]  # none even reached the page check
    assert split.procs["worker"].poll() is None


def _encoded(msg: Any) -> list[bytes]:
    from actorlm.messages.envelope import Codec, Envelope

    frames = Codec().encode(Envelope("kv.pages", 1, "x"), msg)
    return [bytes(f) for f in frames[1:]]


def test_a_killed_prefill_worker_fails_only_the_prompt_it_held(
    split: Split, baseline: dict[str, list[int]]
) -> None:
    decoding = Stream(split.url, max_tokens=1500)  # short prompt: decodes on the decode host
    decoding.start()
    assert decoding.first.wait(30) and not decoding.ended, decoding.events
    victim = split.procs["worker.1"]
    failures = metric(split, "actorlm_pd_transfer_failures")
    os.kill(victim.pid, signal.SIGSTOP)  # holds the next long prompt
    held: list[tuple[int, Any]] = []
    body = {"input_ids": [t + 3 for t in LONG[:150]], "sampling_params": {"max_new_tokens": 4}}
    asking = threading.Thread(target=lambda: held.append(http(f"{split.url}/generate", body)))
    asking.start()
    time.sleep(0.3)  # it reached the prefill replica (and its heartbeats have not failed yet)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    asking.join(30)
    assert held and time.monotonic() - killed < PEER_TIMEOUT_S + 1.5, time.monotonic() - killed
    status, answer = held[0]
    assert status == 503 and "prefill replica" in answer["error"]["message"], answer
    assert metric(split, "actorlm_pd_transfer_failures") == failures + 1
    assert not decoding.ended  # still streaming...
    decoding.join(120)
    assert decoding.events[-1] == "[DONE]" and not decoding.failed_cleanly  # ...to its end
    victim.wait(10)
    remote = metric(split, "actorlm_pd_remote_prefills")
    assert split.greedy(FRESH)[0] == baseline["fresh"]  # down: prefilled where it decodes
    assert metric(split, "actorlm_pd_remote_prefills") == remote
    split.start("worker.1")
    deadline = time.monotonic() + 120
    while "kv_sent_bytes" not in stats(split).get("worker.1", {}):
        assert time.monotonic() < deadline, split.log_tail()
        time.sleep(0.2)
    time.sleep(4 * 0.2)  # a few heartbeats: the decode scheduler has heard it too
    assert split.greedy(AGAIN)[0] == baseline["again"]
    assert metric(split, "actorlm_pd_remote_prefills") == remote + 1  # back on the prefill host
    got = stats(split)
    for role in ("cache_manager", "cache_manager.1"):
        assert got[role]["consistent"] and got[role]["pages_private"] == 0, got[role]


def test_a_killed_decode_worker_fails_its_requests_and_a_late_transfer_writes_nothing(
    split: Split, baseline: dict[str, list[int]]
) -> None:
    decoding = Stream(split.url, max_tokens=1500)
    decoding.start()
    assert decoding.first.wait(30) and not decoding.ended, decoding.events
    prefill, victim = split.procs["worker.1"], split.procs["worker"]
    os.kill(prefill.pid, signal.SIGSTOP)  # a long prompt waits there...
    held: list[tuple[int, Any]] = []
    body = {"input_ids": [t + 5 for t in LONG[:150]], "sampling_params": {"max_new_tokens": 4}}
    asking = threading.Thread(target=lambda: held.append(http(f"{split.url}/generate", body)))
    asking.start()
    time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)  # ...when the worker it decodes on dies
    killed = time.monotonic()
    os.kill(prefill.pid, signal.SIGCONT)  # its KV then goes to a worker that is gone
    asking.join(30)
    decoding.join(30)
    assert held and time.monotonic() - killed < PEER_TIMEOUT_S + 1.5  # both ended promptly
    assert decoding.ended - killed < PEER_TIMEOUT_S + 1.5, decoding.ended - killed
    assert decoding.failed_cleanly, decoding.events[-3:]
    assert held and held[0][0] == 503, held
    victim.wait(10)
    deadline = time.monotonic() + 10
    while "worker" not in split.health()[1].get("down", []):  # the gateway saw it go
        assert time.monotonic() < deadline, split.health()
        time.sleep(0.05)
    split.start("worker")
    split.wait_healthy()
    time.sleep(4 * 0.2)  # a few heartbeats: every scheduler has heard it
    deadline = time.monotonic() + 60
    while "pd_remote_prefills" not in (before := stats(split))["scheduler"]:
        assert time.monotonic() < deadline, before  # a stats read can time out (5 s)
        time.sleep(0.5)
    remote = before["scheduler"]["pd_remote_prefills"]
    assert split.greedy(THIRD)[0] == baseline["third"]  # a pool that is whole
    got = stats(split)
    assert got["scheduler"]["pd_remote_prefills"] == remote + 1
    assert got["worker"]["kv_expected"] == 0
    for role in ("cache_manager", "cache_manager.1"):
        assert got[role]["consistent"] and got[role]["pages_private"] == 0, got[role]


def test_drain_loses_no_remote_prefill(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", "--shutdown-timeout", "60"]
    cmd += ["--prefill-replicas", "1", "--max-local-prefill-tokens", str(THRESHOLD)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        served.wait_healthy()
        streams = [
            Stream(
                served.url, prompt=LONG[i:], max_tokens=200, stream_options={"include_usage": True}
            )
            for i in range(4)
        ]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 30
        while metric(served, "actorlm_gateway_in_flight_requests") < len(streams):
            assert time.monotonic() < deadline, served.log_tail()
            time.sleep(0.01)
        status, body = http(f"{served.url}/drain", {})
        assert status == 200 and body["draining"], body
        assert proc.wait(90) == 0, served.log_tail()
        for s in streams:
            s.join(10)
            chunks = [json.loads(e) for e in s.events if e.startswith("{")]
            assert chunks and chunks[-1]["usage"]["completion_tokens"] == 200, s.events[-3:]
            assert s.events[-1] == "[DONE]"
        assert "remote prefill" not in log.read_text(errors="replace")  # none failed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
