"""Talking to a running server from tests: plain HTTP calls and a streaming request
that records how it ended (no extra packages)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Stream", "get_text", "http", "stop", "wait_for_log"]


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Stop a server as an operator would (SIGTERM), killing it if it hangs."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def get_text(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class Stream(threading.Thread):
    """A long streaming completion; records when and how it ended."""

    def __init__(self, url: str, **body: Any) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body  # merged over the default request (a model, max_tokens, ...)
        self.events: list[str] = []
        self.ended = 0.0
        self.first = threading.Event()

    def run(self) -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        body.update(self.body)
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except OSError as exc:
            self.events.append(f"closed: {exc}")
        self.ended = time.monotonic()
        self.first.set()

    @property
    def failed_cleanly(self) -> bool:
        return any('"error"' in e for e in self.events)


def wait_for_log(path: Path, *needles: str, timeout: float = 10.0) -> str:
    """``path``'s text once it holds every one of ``needles`` (fails the test if not)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace")
        if all(n in text for n in needles):
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} never said {needles}:\n{text[-2000:]}")
        time.sleep(0.1)
