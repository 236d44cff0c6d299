"""A plugin's router policy, chosen by name (``--router-policy``), routes the requests
of two data-parallel replicas: the example plugin's sends every one to the last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import plugin_env, read_records

ENGINE = """
import json, sys
from actorlm import Engine
with Engine(sys.argv[1], placement="inproc", kv_cache_gb=0.02, dp_size=2,
            router_policy="example_last_replica") as engine:
    outs = [engine.generate([5, 6, 7, i], {"max_new_tokens": 2}).finish_reason for i in range(3)]
    print(json.dumps({"outs": outs, "router": engine.stats()["tokenizer"]}))
"""


def test_a_plugin_router_policy_chosen_by_name(
    plugin_site: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    (tmp_path / "records").mkdir()
    env = plugin_env(plugin_site, tmp_path / "records", ACTORLM_PLUGINS="example")
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, str(tiny_llama)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["outs"] == ["length"] * 3
    assert out["router"]["router_policy"] == "example_last_replica"
    assert out["router"]["router_routed"] == [0, 3]
    chose = read_records(tmp_path / "records")["router.choose"]
    assert len(chose) == 3 and len({pid for pid, _ in chose}) == 1  # in the tokenizer's process
