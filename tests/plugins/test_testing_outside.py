"""actorlm's pytest plugin outside this repository: the guide's harness example, and the
``plugins=`` and engine fixtures, run by pytest in an empty folder with only the
installed package (no conftest, no ``tests`` package, no repository on ``sys.path``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]

# A plugin author's tests beside the guide's example: the example plugin loaded by its
# entry point name, and an Engine over the tiny model.
PLUGIN_TESTS = """
import pytest
from actorlm.actors.runtime import RemoteError
from actorlm.messages.generate import GenerateRequest


# twice: the second test loads the plugin after the first's teardown forgot it
@pytest.mark.parametrize("again", [False, True])
def test_a_loaded_plugins_interceptors_form_the_chain(actorlm_harness, again):
    h = actorlm_harness("tokenizer", plugins=["example"])

    async def main():
        await h.send(GenerateRequest(rid="a", text="hello"), sender="gateway")
        assert len(h.sent("scheduler")) == 1
        with pytest.raises(RemoteError, match="example plugin: this prompt is not allowed"):
            await h.send(GenerateRequest(rid="b", text="FORBIDDEN"), sender="gateway")

    actorlm_harness.run(main())


@pytest.mark.parametrize("role", ["scheduler", "cache_manager"])
def test_every_role_starts_on_the_default_config(actorlm_harness, role):
    assert actorlm_harness(role).actor.config.model.num_pages > 0


def test_an_unknown_plugin_is_an_error(actorlm_harness):
    with pytest.raises(RuntimeError, match="nope: no such actorlm.plugins entry point"):
        actorlm_harness("tokenizer", plugins=["nope"])


def test_an_engine_over_the_tiny_model(actorlm_engine, actorlm_tiny_model):
    engine = actorlm_engine(max_prefill_tokens=256)
    out = engine.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
    assert len(out.token_ids) == 3
    assert engine.config.model.path == str(actorlm_tiny_model)
"""


def outside_env(**env: str) -> dict[str, str]:
    """This environment without anything that points pytest or actorlm at the repository."""
    drop = ("ACTORLM_", "PYTEST_", "PYTHONPATH")
    full = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    full.update(PYTHONUNBUFFERED="1", **env)
    return full


def run_pytest(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cache = ROOT / "tests" / ".cache" / "outside-pytest"  # the tokenizer, converted once
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", f"cache_dir={cache}"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip


@pytest.mark.timeout(600)
def test_the_guides_example_passes_outside_the_repository(
    tmp_path: Path, plugin_site: Path
) -> None:
    folder = tmp_path / "my-plugin-tests"
    folder.mkdir()
    assert ROOT not in folder.parents  # no conftest or pyproject of this repository above it
    (folder / "test_harness_example.py").write_text((HERE / "test_harness_example.py").read_text())
    (folder / "test_plugin.py").write_text(PLUGIN_TESTS)
    # The example plugin is installed as a plugin author's would be; the record folder
    # keeps its record() calls out of everything else.
    env = outside_env(PYTHONPATH=str(plugin_site), ACTORLM_EXAMPLE_RECORD=str(tmp_path))

    done = run_pytest(folder, env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 passed" in done.stdout, done.stdout
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".py") == [
        "test_harness_example.py",
        "test_plugin.py",
    ]


def test_the_plugin_imports_nothing_heavy() -> None:
    """pytest imports actorlm.testing in every project where actorlm is installed."""
    code = (
        "import sys, actorlm.testing\n"
        "print(sorted(m for m in ('torch', 'transformers', 'zmq') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=outside_env(), capture_output=True, text=True,
        cwd="/", timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
