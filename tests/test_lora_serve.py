"""LoRA over HTTP, under ``actorlm serve`` (the lora_loader a supervised process of its
own): adapters named by ``model`` and ``lora_path``, listed by /v1/models, loaded and
unloaded through SGLang's and vLLM's routes, broken ones refused with a 4xx while the
server keeps serving, metrics; and the loader killed while it loads: the requests that
needed it fail at once, base requests stream on, it restarts, serving goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from actorlm.actors.runtime.transport import free_port

from tests.servers import Stream, get_text, http, stop
from tests.test_serve import role_pids

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 923, 4, 4, 88, 1200, 31, 7]


class LoraServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while http(f"{self.url}/health")[0] != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.tail()
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def complete(self, model: str, n: int = 6) -> tuple[int, Any]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0}
        return http(f"{self.url}/v1/completions", {**body, "ignore_eos": True})

    def generate(self, lora: str | None, n: int = 6) -> tuple[int, Any]:
        body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}}
        body["sampling_params"].update(temperature=0, ignore_eos=True)
        if lora is not None:
            body["lora_path"] = lora
        return http(f"{self.url}/generate", body)


@pytest.fixture(scope="module")
def server(
    tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoraServer]:
    port = free_port()
    log = tmp_path_factory.mktemp("lora-serve") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama),
           "--port", str(port), "--kv-cache-gb", "0.05", "--quantization", "none",
           "--max-loras-per-batch", "2", "--max-lora-rank", "16",
           "--lora-paths", f"sql={lora_adapters['sql']}", f"chat={lora_adapters['chat']}"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = LoraServer(proc, f"http://127.0.0.1:{port}", log)
    try:
        s.wait_healthy()
        yield s
    finally:
        stop(proc)


def test_adapters_by_model_and_lora_path_and_in_the_model_list(server: LoraServer) -> None:
    status, models = http(f"{server.url}/v1/models")
    assert status == 200
    cards = {m["id"]: m for m in models["data"]}
    base = models["data"][0]["id"]
    assert set(cards) == {base, "sql", "chat"}
    assert cards["sql"]["parent"] == base and cards["chat"]["root"].endswith("chat")
    assert http(f"{server.url}/v1/models/chat")[1]["parent"] == base
    status, out = server.complete("sql")
    assert status == 200 and out["model"] == "sql"
    native = server.generate("sql")[1]["output_ids"]
    assert [*native] and native != server.generate(None)[1]["output_ids"]
    assert server.complete(base)[1]["choices"][0]["text"] != out["choices"][0]["text"]
    # an unknown adapter is a 404, by either name, streaming or not
    for status, body in (
        server.complete("nope"),
        server.generate("nope"),
        http(f"{server.url}/v1/completions", {"model": "nope", "prompt": "x", "stream": True}),
    ):
        assert status == 404 and "'nope' does not exist" in body["error"]["message"], body


def test_load_and_unload_routes_under_both_names(
    server: LoraServer, lora_adapters: dict[str, Path]
) -> None:
    for prefix in ("", "/v1"):
        body = {"lora_name": "all", "lora_path": str(lora_adapters["all"])}
        status, out = http(f"{server.url}{prefix}/load_lora_adapter", body)
        assert status == 200 and out["success"] and out["adapter"]["rank"] == 16, out
        assert server.complete("all")[0] == 200
        status, again = http(f"{server.url}{prefix}/load_lora_adapter", body)
        assert status == 409 and "already loaded" in again["error"]["message"]
        other = "/unload_lora_adapter" if prefix else "/v1/unload_lora_adapter"
        status, out = http(f"{server.url}{other}", {"lora_name": "all"})
        assert status == 200 and out["success"], out
        assert server.complete("all")[0] == 404
    status, out = http(f"{server.url}/unload_lora_adapter", {"lora_name": "all"})
    assert status == 404 and "no LoRA adapter named 'all'" in out["error"]["message"]
    assert out["error"]["code"] == "not_found"
    assert http(f"{server.url}/load_lora_adapter", {"lora_name": "x"})[0] == 400
    base = http(f"{server.url}/v1/models")[1]["data"][0]["id"]
    for name in (base, "default"):  # requests naming these get the base model
        body = {"lora_name": name, "lora_path": str(lora_adapters["all"])}
        status, out = http(f"{server.url}/load_lora_adapter", body)
        assert status == 409 and "names the base model" in out["error"]["message"], out


def _broken(kind: str, good: Path, tmp: Path) -> Path:
    bad = tmp / kind
    if kind == "missing":
        return bad
    if kind == "not_a_directory":
        bad.write_text("x")
        return bad
    subprocess.run(["cp", "-r", str(good), str(bad)], check=True)
    weights = bad / "adapter_model.safetensors"
    if kind == "corrupt":
        weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    elif kind == "no_weights":
        weights.unlink()
    return bad


BROKEN = {
    "missing": "no such directory",
    "not_a_directory": "not a directory",
    "corrupt": "is corrupt",
    "no_weights": "adapter_model.safetensors is missing",
    "rank": "is more than --max-lora-rank 16",
    "shapes": "trained for another model",
}


def test_broken_adapters_get_a_4xx_while_the_server_serves(
    server: LoraServer, lora_adapters: dict[str, Path], tiny_model_factory: Any, tmp_path: Path
) -> None:
    from tests.models import build_lora_adapter

    bad = {kind: _broken(kind, lora_adapters["sql"], tmp_path) for kind in BROKEN}
    bad["rank"] = build_lora_adapter(tiny_model_factory("llama"), tmp_path / "r32", r=32)
    wide = tiny_model_factory("llama", hidden_size=96)
    bad["shapes"] = build_lora_adapter(wide, tmp_path / "wide", r=4)
    stream = Stream(server.url, model="chat", max_tokens=200)
    stream.start()
    assert stream.first.wait(30)
    for kind, says in BROKEN.items():
        body = {"lora_name": kind, "lora_path": str(bad[kind])}
        status, out = http(f"{server.url}/load_lora_adapter", body)
        assert status == 400, out
        assert f"adapter '{kind}'" in out["error"]["message"], out
        assert says in out["error"]["message"], out
    stream.join(60)  # it streamed on through all of that
    assert not stream.failed_cleanly and '"finish_reason":"length"' in "".join(stream.events)
    names = {m["id"] for m in http(f"{server.url}/v1/models")[1]["data"]}
    assert not names & set(BROKEN)


@pytest.mark.parametrize("kind", ["corrupt", "no_weights", "rank", "base_name", "pins"])
def test_a_start_up_adapter_the_loader_would_refuse_stops_the_start(
    kind: str, tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    from actorlm.config import EngineConfig, LoraConfig, ModelConfig
    from actorlm.launch import ConfigError, resolve_config

    sql = f"sql={lora_adapters['sql']}"
    specs, says = {
        "corrupt": ([f"bad={_broken('corrupt', lora_adapters['sql'], tmp_path)}"], "is corrupt"),
        "no_weights": ([f"bad={_broken('no_weights', lora_adapters['sql'], tmp_path)}"], "missing"),
        "rank": ([sql], "is more than --max-lora-rank 2"),
        "base_name": ([f"default={lora_adapters['sql']}"], "names the base model"),
        "pins": ([f"{sql}:pinned", f"chat={lora_adapters['chat']}:pinned"], "pins 2 adapters"),
    }[kind]
    lora = LoraConfig(
        lora_paths=specs, max_loras_per_batch=2, max_lora_rank=2 if kind == "rank" else 16
    )
    config = EngineConfig(model=ModelConfig(path=str(tiny_llama), device="cpu"), lora=lora)
    with pytest.raises(ConfigError, match=says):
        resolve_config(config)
    ok = msgspec.structs.replace(lora, lora_paths=[sql], max_lora_rank=16)
    assert resolve_config(msgspec.structs.replace(config, lora=ok)).lora.lora_paths == [sql]


def test_lora_metrics(server: LoraServer) -> None:
    server.complete("sql", 2)
    status, text = get_text(f"{server.url}/metrics")
    assert status == 200
    assert "actorlm_lora_adapters_loaded 2.0" in text
    for name in ("slot_hits", "slot_misses", "slot_loads", "slot_evictions", "adapter_loads"):
        assert f"actorlm_lora_{name} " in text, name


def test_the_loader_killed_mid_load(
    server: LoraServer, lora_adapters: dict[str, Path], tiny_llama: Path
) -> None:
    """Killed while it loads an adapter and while a request waits on it: that request and
    the load fail at once (503), the base stream goes on, the supervisor restarts the
    loader from --lora-paths (what was loaded later is gone), and serving goes on."""
    assert server.complete("sql")[0] == 200
    body = {"lora_name": "all", "lora_path": str(lora_adapters["all"])}
    assert http(f"{server.url}/load_lora_adapter", body)[0] == 200
    before = role_pids(server.proc.pid)
    base = Stream(server.url, max_tokens=600)
    adapted = Stream(server.url, model="chat", max_tokens=600)
    base.start()
    adapted.start()
    assert base.first.wait(30) and adapted.first.wait(30)
    loading: dict[str, Any] = {}
    load = threading.Thread(
        target=lambda: loading.update(
            answer=http(
                f"{server.url}/load_lora_adapter",
                {"lora_name": "late", "lora_path": str(lora_adapters["sparse"])},
            )
        )
    )
    waiting = Stream(server.url, model="all", max_tokens=600)  # needs a slot load
    load.start()
    waiting.start()
    os.kill(before["lora_loader"], signal.SIGKILL)
    killed = time.monotonic()
    for stream in (adapted, waiting):
        stream.join(30)
        assert stream.ended and stream.ended - killed < 2.0, stream.events[-2:]
        # it ended with an error (or, had it not started yet, the lora_loader was down)
        assert stream.failed_cleanly or "503" in "".join(stream.events), stream.events[-2:]
    load.join(30)
    assert loading["answer"][0] in (200, 503), loading  # done just before, or failed: no hang
    assert base.is_alive()  # the base model's stream goes on
    server.wait_healthy()
    after = role_pids(server.proc.pid)
    assert after["lora_loader"] != before["lora_loader"]
    assert {r: after[r] for r in before if r != "lora_loader"} == {
        r: p for r, p in before.items() if r != "lora_loader"
    }
    assert server.complete("sql")[0] == 200  # from --lora-paths again
    status, out = server.complete("all")
    assert status == 404, out  # loaded by request into the dead loader: load it again
    assert http(f"{server.url}/load_lora_adapter", body)[0] == 200
    assert server.complete("all")[0] == 200
    base.join(120)
    assert not base.failed_cleanly and '"finish_reason":"length"' in "".join(base.events)
    status, info = http(f"{server.url}/get_server_info")
    assert info["stats"]["lora_loader"]["adapter_refs"] == 0
    assert info["stats"]["scheduler"]["lora_requests"] == 0
    assert info["stats"]["cache_manager"]["consistent"]


def test_a_restarted_worker_gets_its_adapters_back(server: LoraServer) -> None:
    """The worker killed while an adapter's request streams: that request fails at once,
    the restarted worker's slots fill again on demand, and every adapter gives the same
    tokens as before (no slot serves another adapter's weights, no KV of the dead pool)."""
    before = {name: server.complete(name)[1]["choices"][0]["text"] for name in ("sql", "chat")}
    pids = role_pids(server.proc.pid)
    stream = Stream(server.url, model="sql", max_tokens=600)
    stream.start()
    assert stream.first.wait(30)
    os.kill(pids["worker"], signal.SIGKILL)
    killed = time.monotonic()
    stream.join(30)
    assert stream.failed_cleanly and stream.ended - killed < 2.0, stream.events[-2:]
    server.wait_healthy()
    assert role_pids(server.proc.pid)["worker"] != pids["worker"]
    for name, text in before.items():
        status, out = server.complete(name)
        assert status == 200 and out["choices"][0]["text"] == text, (name, out)
