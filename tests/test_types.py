"""mypy over the package, as configured in pyproject.toml (strict for ``messages/`` and
``extensions/``): the suite fails on a type error, so the annotations stay true.

The repository root is the package, so mypy is pointed at a folder holding one link,
``actorlm`` → the root, and checks ``-p actorlm`` (tests, bench and scripts excluded).
Third-party code is read for its types only (``--follow-imports=silent``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import actorlm
import pytest

ROOT = Path(actorlm.__file__).resolve().parent


def test_mypy_finds_no_errors(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    (tmp_path / "actorlm").symlink_to(ROOT, target_is_directory=True)
    cmd = [
        sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"), "--follow-imports=silent",
        "--exclude", r"/(tests|bench|scripts|\.venv)/", "-p", "actorlm",
    ]  # fmt: skip
    env = {"MYPYPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout


def test_the_package_ships_its_types() -> None:
    assert (ROOT / "py.typed").is_file()  # PEP 561 marker, listed in package-data
