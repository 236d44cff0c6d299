"""Actors started one by one (``actorlm actor ROLE --deploy``) on four loopback addresses
standing for four hosts, and ``actorlm serve --deploy`` in front: every role killed
under load is noticed without a supervisor, its in-flight requests fail promptly,
``/health`` names it, and once it is started again serving resumes with the tokens a
fresh deployment gives, from a KV pool that is whole (issue 26)."""

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
from actorlm.actors.runtime.keys import create_keys
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, http, wait_for_log

pytestmark = pytest.mark.timeout(600)

ROLES = ("tokenizer", "scheduler", "cache_manager", "worker")
HOSTS = {role: f"127.0.0.{i + 2}" for i, role in enumerate(ROLES)}
PEER_TIMEOUT_S = 1.0
PROMPT_CACHED = list(range(300, 340))  # 40 tokens: two full pages cached before each kill
PROMPT_NEW = [7, 11, 13, 17, 19, 23, 29, 31]


def write_deployment(path: Path, model: Path, port: int) -> None:
    keys = path.parent / "keys"
    create_keys(keys)
    lines = [
        f'[model]\npath = "{model}"\nkv_cache_gb = 0.05\n',
        f"[server]\nport = {port}\n",
        f"[deploy]\npeer_timeout_s = {PEER_TIMEOUT_S}\nheartbeat_s = 0.2\nstart_timeout_s = 60\n"
        f'keys_dir = "{keys}"\n',
    ]
    for role, host in HOSTS.items():
        lines.append(f'[actors.{role}]\naddress = "tcp://{host}:{free_port(host)}"\n')
    path.write_text("\n".join(lines))


@dataclass
class Split:
    deploy: Path
    url: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    baseline: dict[str, list[int]] = field(default_factory=dict)

    def start(self, role: str) -> None:
        cmd = [sys.executable, "-m", "actorlm.cli"]
        cmd += ["serve"] if role == "gateway" else ["actor", role]
        log = (self.logs / f"{role}.log").open("ab")
        self.procs[role] = subprocess.Popen(
            [*cmd, "--deploy", str(self.deploy)], stdout=log, stderr=subprocess.STDOUT
        )

    def stop_all(self) -> None:
        """SIGTERM to every process still running; SIGKILL to one still there 20 s on."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def health(self) -> tuple[int, Any]:
        return http(f"{self.url}/health")

    def wait_healthy(self, timeout: float = 120) -> float:
        start = time.monotonic()
        while self.health()[0] != 200:
            assert time.monotonic() - start < timeout, self.log_tail()
            time.sleep(0.1)
        return time.monotonic() - start

    def greedy(self, prompt: list[int], n: int = 12) -> tuple[list[int], int]:
        status, body = http(
            f"{self.url}/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            },
        )
        assert status == 200, body
        return body["output_ids"], body["meta_info"]["cached_tokens"]

    def cache_stats(self) -> dict[str, Any]:
        status, info = http(f"{self.url}/get_server_info")
        assert status == 200
        return dict(info["stats"]["cache_manager"])

    def log_tail(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in self.logs.glob("*.log")
        )


@pytest.fixture(scope="module")
def split(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("split")
    port = free_port()
    deploy = tmp / "cluster.toml"
    write_deployment(deploy, tiny_llama, port)
    s = Split(deploy, f"http://127.0.0.1:{port}", tmp)
    try:
        for role in ROLES:
            s.start(role)
        s.start("gateway")
        s.wait_healthy()
        s.baseline = {"cached": s.greedy(PROMPT_CACHED)[0], "new": s.greedy(PROMPT_NEW)[0]}
        yield s
    finally:
        s.stop_all()


@pytest.mark.parametrize("role", ["worker", "cache_manager", "scheduler", "tokenizer"])
def test_a_killed_actor_is_noticed_and_rejoins(split: Split, role: str) -> None:
    assert split.greedy(PROMPT_CACHED)[0] == split.baseline["cached"]  # cached before the kill
    stream = Stream(split.url)
    stream.start()
    assert stream.first.wait(30) and not stream.ended, stream.events
    split.procs[role].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    stream.join(30)
    assert stream.ended, "the in-flight stream hung"
    assert stream.ended - killed < PEER_TIMEOUT_S + 1.5, stream.ended - killed
    assert stream.failed_cleanly, stream.events[-3:]
    while True:  # the gateway's own view: within the detection time too
        status, body = split.health()
        if status == 503 and role in body.get("down", []):
            break
        assert time.monotonic() - killed < PEER_TIMEOUT_S + 1.5, body
        time.sleep(0.05)
    status, body = http(f"{split.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503, body  # refused at once, never a hang
    split.procs[role].wait(10)
    split.start(role)
    split.wait_healthy()
    out, cached = split.greedy(PROMPT_CACHED)
    assert out == split.baseline["cached"], f"stale KV after the {role} restarted"
    assert split.greedy(PROMPT_NEW)[0] == split.baseline["new"]
    stats = split.cache_stats()
    assert stats["consistent"] and stats["running_requests"] == 0 and stats["pages_private"] == 0


def _raw_push(address: str, keys: Path | None, server: str = "tokenizer") -> Any:
    import zmq
    import zmq.auth

    sock = zmq.Context.instance().socket(zmq.PUSH)
    if keys is not None:  # a real key pair: the client's
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(
            keys / "client.key_secret"
        )
        sock.curve_serverkey, _ = zmq.auth.load_certificate(keys / f"{server}.key")
    sock.connect(address)
    return sock


def test_a_peer_without_the_key_commands_nothing(split: Split) -> None:
    import msgspec
    from actorlm.launch import load_deployment
    from actorlm.messages.control import Shutdown
    from actorlm.messages.envelope import Envelope, Kind

    address = load_deployment(split.deploy).addresses["tokenizer"]
    keys = split.deploy.parent / "keys"
    enc = msgspec.msgpack.encode

    def shutdown(sender: str) -> list[bytes]:
        return [enc(Envelope("ctl.shutdown", 1, sender, Kind.SEND)), enc(Shutdown(reason="x"))]

    stranger = _raw_push(address, None)  # no key: the CURVE handshake never completes
    stranger.send_multipart([b"\xc1garbage", b""])  # would be logged as rejected if it arrived
    stranger.send_multipart(shutdown("supervisor"))
    forger = _raw_push(address, keys)  # a client's key, posing as the supervisor
    forger.send_multipart(shutdown("supervisor"))
    client = _raw_push(address, keys)  # a client, as itself: not the supervisor either
    client.send_multipart(shutdown("client-raw"))
    log = split.logs / "tokenizer.log"
    wait_for_log(log, "its key is client's", "obeyed only from the supervisor")
    for sock in (stranger, forger, client):
        sock.close(linger=0)
    time.sleep(0.5)
    assert "rejected a message" not in log.read_text(errors="replace")  # nothing got in
    assert split.procs["tokenizer"].poll() is None  # still running
    assert split.health()[0] == 200


def test_serve_deploy_names_a_missing_peer_and_gives_up(tiny_llama: Path, tmp_path: Path) -> None:
    deploy = tmp_path / "cluster.toml"
    write_deployment(deploy, tiny_llama, free_port())
    text = deploy.read_text().replace("start_timeout_s = 60", "start_timeout_s = 3")
    deploy.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "actorlm.cli", "serve", "--deploy", str(deploy)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 1
    assert "waiting for tokenizer, scheduler, cache_manager, worker" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("actorlm: error")]
    assert len(errors) == 1 and "did not come up within 3s" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
