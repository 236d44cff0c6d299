"""Install the example plugin packages with pip, into a folder of their own.

Not into ``.venv``: an installed plugin loads in every actor process, and would
change every other test. Tests put the folder on ``PYTHONPATH`` of a subprocess
(actor processes inherit the environment and ``sys.path``) and name the plugins
they allow in ``ACTORLM_PLUGINS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PACKAGES = ("actorlm_example_plugin", "actorlm_example_platform")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding both example distributions, installed by pip."""
    site = tmp_path_factory.mktemp("plugin-site")
    build = tmp_path_factory.mktemp("plugin-build")
    for pkg in PACKAGES:
        # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
        src = build / pkg
        subprocess.run(["cp", "-r", str(HERE / pkg), str(src)], check=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    return site


def plugin_env(site: Path, record: Path, **env: str) -> dict[str, str]:
    """The environment of a process with the example plugins installed.

    Every ``ACTORLM_*`` variable of the test process is dropped, so a test states
    each one it depends on (``ACTORLM_PLUGINS`` above all)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ACTORLM_")}
    full["PYTHONPATH"] = str(site)
    full["ACTORLM_EXAMPLE_RECORD"] = str(record)
    full["PYTHONUNBUFFERED"] = "1"
    full.update(env)
    return full


def read_records(folder: Path) -> dict[str, list[tuple[int, int]]]:
    """event → [(pid, n), ...] as ``record()`` in the plugins wrote them."""
    out: dict[str, list[tuple[int, int]]] = {}
    for f in folder.iterdir():
        out[f.name] = [
            (int(pid), int(n)) for pid, n in (line.split() for line in f.read_text().splitlines())
        ]
    return out


def run_python(
    args: Iterable[str], env: Mapping[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=dict(env), capture_output=True, text=True, timeout=timeout
    )


RunPython = Callable[..., subprocess.CompletedProcess[str]]
