"""``POST /drain``: the server stops admitting at once, lets the stream in flight run to
its last token within ``--shutdown-timeout``, then every process exits (issue 21)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, http
from tests.test_serve import Served, role_pids

pytestmark = pytest.mark.timeout(300)

TOKENS = 1800  # a few seconds of stream: the drain lands while it runs (the model holds 2048)


def test_drain_finishes_what_runs_refuses_the_rest_and_exits(
    tiny_llama: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--port", str(port), "--kv-cache-gb", "0.05", "--shutdown-timeout", "60"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        served.wait_healthy()
        children = role_pids(proc.pid)
        stream = Stream(served.url, max_tokens=TOKENS, stream_options={"include_usage": True})
        stream.start()
        assert stream.first.wait(30) and not stream.ended, stream.events
        status, body = http(f"{served.url}/drain", {})
        assert status == 200 and body["draining"] and body["in_flight"] == 1, body
        if not stream.ended:  # still streaming: new clients are answered, and refused
            status, refused = http(f"{served.url}/generate", {"text": "hi"})
            assert status == 503 and refused["error"]["code"] == "shutting_down", refused
            status, health = http(f"{served.url}/health")
            assert status == 503 and health == {"status": "draining"}, health
        assert proc.wait(90) == 0, served.log_tail()
        stream.join(10)
        chunks = [json.loads(e) for e in stream.events if e.startswith("{")]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length", stream.events[-3:]
        assert chunks[-1]["usage"]["completion_tokens"] == TOKENS, chunks[-1]
        assert stream.events[-1] == "[DONE]"
        deadline = time.monotonic() + 10  # every actor process is gone with it
        while any(Path(f"/proc/{pid}").exists() for pid in children.values()):
            assert time.monotonic() < deadline, children
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
