"""Every extension point, filled by real pip-installed plugin packages, taking effect
across real actor processes.

The packages (``actorlm_example_plugin``, ``actorlm_example_platform``) are
installed by pip into a folder of their own (see ``conftest.py``) that only the
subprocesses here get on ``PYTHONPATH``. The plugins leave records (event → the
pid that wrote it) so a test sees which process ran what. Engine starts cost
seconds, so one Engine run and one ``actorlm serve`` run each check several
plugins at once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from actorlm.actors.runtime.transport import free_port

from .conftest import plugin_env, read_records, run_python

HERE = Path(__file__).parent
ALLOW = "example,example_device,example_device_extras"  # not example_disabled
START_TIMEOUT_S = 240


@dataclass
class Run:
    out: dict[str, Any]
    records: dict[str, list[tuple[int, int]]]

    def pids(self, event: str) -> set[int]:
        return {pid for pid, _ in self.records.get(event, [])}

    def total(self, event: str) -> int:
        return sum(n for _, n in self.records.get(event, []))


@pytest.fixture(scope="module")
def example_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved under the plugin's architecture name."""
    out = tmp_path_factory.mktemp("example-arch") / "tiny-example"
    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["ExampleLlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def runs(
    plugin_site: Path,
    example_model: Path,
    tiny_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Run]:
    """The Engine run and the ``actorlm serve`` run, started side by side (their
    start-ups mostly wait), each checking several plugins."""
    tmp = tmp_path_factory.mktemp("engine-run")
    (tmp / "records").mkdir()
    # Every plugin selected by flag; the example platform is installed, its hardware absent.
    env = plugin_env(plugin_site, tmp / "records", ACTORLM_PLUGINS=ALLOW)
    cmd = [sys.executable, str(HERE / "engine_run.py"), str(example_model), str(tmp / "kv")]
    with (tmp / "stderr").open("w") as err:
        engine = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    try:
        served = _serve_run(plugin_site, tiny_llama, tmp_path_factory)
        stdout, _ = engine.communicate(timeout=START_TIMEOUT_S)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert engine.returncode == 0, (tmp / "stderr").read_text()[-6000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    return {"engine": Run(out, read_records(tmp / "records")), "serve": served}


@pytest.fixture(scope="module")
def engine_run(runs: dict[str, Run]) -> Run:
    return runs["engine"]


@pytest.fixture(scope="module")
def serve_run(runs: dict[str, Run]) -> Run:
    return runs["serve"]


def test_hooks_of_all_four_kinds_take_effect_in_the_actor_processes(engine_run: Run) -> None:
    out = engine_run.out
    generated = [out["reference"], out["capped"], out["after_rejects"], out["forced"]]
    generated += [out["constrained"]]
    generated += out["pressure"] + [out["again"]]
    # REPLACE of the Sampler class: the worker built the plugin's subclass, once.
    (worker,) = engine_run.pids("sampler.init")
    assert engine_run.total("sampler.init") == 1
    # AROUND Sampler.sample reached the replacement class: one row per generated token,
    # and at most one more for each request that ended with its next step in flight.
    assert engine_run.pids("sampler.sample") == {worker}
    extra = engine_run.out["stats"]["scheduler"]["zombies"]
    tokens = sum(g["completion_tokens"] for g in generated)
    assert tokens <= engine_run.total("sampler.sample") <= tokens + extra
    # BEFORE BatchPlanner.add, in the scheduler: every request that got past both
    # rejecting interceptors (the forbidden prompt and the negative priority did not),
    # the bad logit-processor request included (refused where it is built: the worker).
    (scheduler,) = engine_run.pids("planner.add")
    accepted = len(generated) + 1
    assert engine_run.total("planner.add") == accepted
    # AFTER the tokenizer's check: that, plus the negative-priority request (refused
    # later, at the scheduler).
    (tokenizer,) = engine_run.pids("tokenizer.check")
    assert engine_run.total("tokenizer.check") == accepted + 1
    assert len({worker, scheduler, tokenizer, out["pid"]}) == 4  # four processes


def test_interceptor_rewrites_sampling_parameters(engine_run: Run) -> None:
    capped = engine_run.out["capped"]  # asked for 30 tokens, ignore_eos
    assert capped["completion_tokens"] == len(capped["token_ids"]) == 8
    assert capped["finish_reason"] == "length"
    assert engine_run.pids("interceptor.capped") == engine_run.pids("planner.add")  # scheduler
    assert engine_run.total("interceptor.capped") == 1  # the others asked for 8 or fewer


def test_interceptors_reject_with_a_clear_error_and_the_engine_keeps_serving(
    engine_run: Run,
) -> None:
    out = engine_run.out
    assert out["forbidden"] == {
        "message": "example plugin: this prompt is not allowed",
        "status": 400,
    }  # refused by the tokenizer's interceptor
    assert out["negative_priority"] == {
        "message": "example plugin: priority -1 is below 0",
        "status": 400,
    }  # refused by the scheduler's interceptor, reported back through the tokenizer
    assert out["after_rejects"]["completion_tokens"] == 4
    assert out["after_rejects"]["finish_reason"] == "length"


def test_model_architecture_from_a_plugin_serves_correct_tokens(
    engine_run: Run, tiny_llama: Path
) -> None:
    import torch
    from transformers import LlamaForCausalLM

    (worker,) = engine_run.pids("sampler.init")
    assert engine_run.pids("model.init") == {worker}
    # The same weights through transformers, greedy: the plugin's class serves them right.
    model = LlamaForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    ids = list(engine_run.out["reference_prompt"])
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert engine_run.out["reference"]["token_ids"] == ids[-6:]


def test_attention_backend_and_weight_loader_chosen_by_flag(engine_run: Run) -> None:
    (worker,) = engine_run.pids("sampler.init")
    assert engine_run.pids("attention.step") == {worker}
    # init_forward_metadata runs once per forward step.
    assert engine_run.total("attention.step") == engine_run.out["stats"]["worker"]["steps"] > 0
    assert engine_run.pids("loader.tensors") == {worker}
    assert engine_run.total("loader.tensors") > 0  # every tensor of the model came through it


def test_eviction_policy_and_storage_backend_chosen_by_flag(engine_run: Run) -> None:
    out = engine_run.out
    (worker,) = engine_run.pids("sampler.init")
    (cache_manager,) = engine_run.pids("eviction.init")
    assert cache_manager not in (worker, out["pid"])
    # Six 150-token prompts through a 32-page pool: the plugin's policy chose victims.
    assert engine_run.pids("eviction.priority") == {cache_manager}
    # The worker saved pages through the plugin's backend and, after the cache was
    # flushed, read the first prompt's pages back instead of computing them.
    assert engine_run.pids("storage.set") == {worker} == engine_run.pids("storage.get")
    assert out["flushed"] is True
    full_pages = 150 // 16
    assert engine_run.total("storage.get") == full_pages
    assert out["stats"]["cache_manager"]["storage_hit_pages"] == full_pages
    assert out["again"]["cached_tokens"] == full_pages * 16
    assert out["again"]["token_ids"] == out["pressure"][0]["token_ids"]


def test_logit_processor_chosen_per_request(engine_run: Run) -> None:
    forced = engine_run.out["forced"]  # temperature 1: random sampling, yet always 42
    assert forced["token_ids"] == [42] * 5
    bad = engine_run.out["bad_processor"]
    assert bad["status"] == 400 and "example_force_token takes exactly" in bad["message"]


def test_grammar_backend_chosen_by_flag(engine_run: Run) -> None:
    constrained = engine_run.out["constrained"]  # temperature 1, yet three digits and eos
    assert constrained["grammar_backend"] == "example_recording_grammar"
    assert len(constrained["text"]) == 3 and constrained["text"].isdigit()
    assert constrained["finish_reason"] == "stop"
    (worker,) = engine_run.pids("sampler.init")
    assert engine_run.pids("grammar.regex") == {worker}  # compiled once, in the worker


def test_allowlist_and_an_unselected_platform(engine_run: Run) -> None:
    report = engine_run.out["report"]  # load_plugins() of the Engine's own process
    status = {p["name"]: p["status"] for p in report["plugins"] + report["platforms"]}
    assert status == {
        "example": "loaded",
        "example_disabled": "not allowed",  # left out of ACTORLM_PLUGINS
        "example_device": "inactive",  # activate() found no device
        "example_device_extras": "skipped",  # its distribution's platform is not active
    }
    assert report["platform"] == "cpu" and report["errors"] == []
    assert [p["name"] for p in report["plugins"]] == sorted(status.keys() - {"example_device"})
    # Neither was imported in any process.
    assert "disabled.register" not in engine_run.records
    assert "extras.imported" not in engine_run.records
    assert "platform.adjust_defaults" not in engine_run.records


# -- the platform plugin, through `actorlm serve` and HTTP ----------------------


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"{}")


def _serve_run(
    plugin_site: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    """``actorlm serve`` with ACTORLM_PLATFORM=example_device and its hardware present."""
    tmp = tmp_path_factory.mktemp("serve-run")
    (tmp / "records").mkdir()
    env = plugin_env(
        plugin_site,
        tmp / "records",
        ACTORLM_PLUGINS="example,example_device_extras",
        ACTORLM_PLATFORM="example_device",
        ACTORLM_EXAMPLE_DEVICE="1",
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama),
           "--port", str(port), "--kv-cache-gb", "0.05"]  # fmt: skip
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    out: dict[str, Any] = {"pid": proc.pid}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if _http(f"{url}/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"actorlm serve did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.3)
        name = _http(f"{url}/v1/models")[1]["data"][0]["id"]
        ask = {"model": name, "temperature": 0, "ignore_eos": True}
        out["forbidden"] = _http(
            f"{url}/v1/completions", {**ask, "prompt": "a FORBIDDEN prompt", "max_tokens": 4}
        )
        out["capped"] = _http(f"{url}/v1/completions", {**ask, "prompt": "Hi", "max_tokens": 30})
        out["info"] = _http(f"{url}/get_server_info")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return Run(out, read_records(tmp / "records"))


def test_platform_plugin_sets_defaults_and_brings_its_plugin(serve_run: Run) -> None:
    out = serve_run.out
    status, info = out["info"]
    assert status == 200
    # adjust_defaults (run in the serving process) chose the platform's attention backend...
    assert info["config"]["model"]["attention_backend"] == "example_device_attention"
    assert serve_run.pids("platform.adjust_defaults") == {out["pid"]}
    # ...which the sibling general plugin registered, and the worker ran.
    (worker,) = serve_run.pids("device_attention.step")
    assert "attention.step" not in serve_run.records  # not the other plugin's backend
    # The sibling plugin of the active platform loaded in every process: the supervisor,
    # the gateway and the four actors.
    extras = serve_run.pids("extras.register")
    assert len(extras) == 6 and {out["pid"], worker} <= extras
    assert "disabled.register" not in serve_run.records


def test_interceptors_over_http(serve_run: Run) -> None:
    status, body = serve_run.out["forbidden"]
    assert status == 400
    assert "example plugin: this prompt is not allowed" in json.dumps(body)
    status, body = serve_run.out["capped"]
    assert status == 200 and body["usage"]["completion_tokens"] == 8


# -- `actorlm plugins` --------------------------------------------------------


def test_actorlm_plugins_lists_plugins_platform_entries_hooks_and_interceptors(
    plugin_site: Path, tmp_path: Path
) -> None:
    env = plugin_env(plugin_site, tmp_path, ACTORLM_PLUGINS=ALLOW, ACTORLM_EXAMPLE_DEVICE="1")
    done = run_python(["-m", "actorlm.cli", "plugins"], env)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    lines = [" ".join(line.split()) for line in text.splitlines()]

    def has(*parts: str) -> bool:
        return any(all(p in line for p in parts) for line in lines)

    assert has(
        "example", "loaded", "dist=actorlm-example-plugin", "actorlm_example_plugin:register"
    )
    assert has("example_disabled", "not allowed", "dist=actorlm-example-plugin")
    assert has("example_device_extras", "loaded", "dist=actorlm-example-platform")
    assert has("example_device", "active", "dist=actorlm-example-platform")
    assert "Active platform: example_device" in lines
    for entry in (
        "ExampleLlamaForCausalLM",
        "example_counting",
        "example_safetensors",
        "example_oldest_first",
        "example_most_used_first",
        "example_recording",
        "example_force_token",
        "example_recording_grammar",
        "example_last_replica",
    ):
        assert f"{entry} [example]" in lines, entry
    assert "xgrammar [builtin]" in lines and "llguidance [builtin]" in lines
    assert "example_device_attention [example_device_extras]" in lines
    assert "example_device [example_device]" in lines
    assert "LlamaForCausalLM [builtin]" in lines  # built-ins keep their source
    for kind, target in (
        ("replace", "actorlm.gpu.sampling.Sampler"),
        ("around", "actorlm.gpu.sampling.Sampler.sample"),
        ("before", "actorlm.actors.scheduler.policy.BatchPlanner.add"),
        ("after", "actorlm.actors.tokenizer.actor.TokenizerActor._check"),
    ):
        assert has(f"{kind} {target} fn=actorlm_example_plugin.hooks.", "[example] applied"), kind
    for interceptor in (
        "scheduler:TokenizedRequest:in fn=cap_max_new_tokens [example]",
        "scheduler:TokenizedRequest:in fn=refuse_negative_priority [example]",
        "tokenizer:GenerateRequest:in fn=refuse_forbidden [example]",
    ):
        assert interceptor in lines
    assert "error:" not in text


def test_selected_platform_without_its_hardware_stops_the_engine(
    plugin_site: Path, example_model: Path, tmp_path: Path
) -> None:
    env = plugin_env(plugin_site, tmp_path, ACTORLM_PLATFORM="example_device")
    code = f"from actorlm import Engine\nEngine({str(example_model)!r})"
    done = run_python(["-c", code], env)
    assert done.returncode != 0
    assert "PlatformError: ACTORLM_PLATFORM='example_device': its activate() returned None" in (
        done.stderr
    )
    assert "hardware is not available" in done.stderr
    assert "extras.imported" not in os.listdir(tmp_path)  # the platform's plugin never loaded


def test_plugin_settings_reach_every_process(engine_run: Run) -> None:
    """--plugin-config example.greeting=hello: register(settings) got it in the Engine's
    process and in the tokenizer, scheduler, cache manager and worker."""
    got = engine_run.pids("settings.greeting=hello")
    actors = {
        engine_run.pids(event).pop()
        for event in ("tokenizer.check", "planner.add", "eviction.priority", "sampler.init")
    }
    assert len(actors) == 4 and got == actors | {engine_run.out["pid"]}
