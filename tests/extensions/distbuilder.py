"""Build real, tiny plugin distributions in a folder, without pip.

``importlib.metadata`` finds any ``*.dist-info`` folder on ``sys.path``, so a
folder holding the package's files and a dist-info (``METADATA`` and
``entry_points.txt``) is, to the entry-point machinery, an installed
distribution. Put the folder on ``PYTHONPATH`` of a subprocess and its plugins
are discovered exactly as a pip-installed one would be.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["run_python", "write_distribution"]


def write_distribution(
    site: Path,
    name: str,
    files: Mapping[str, str],
    entry_points: Mapping[str, Mapping[str, str]],
    version: str = "0.1.0",
) -> Path:
    """Write distribution ``name`` into ``site``; return its dist-info folder.

    ``files`` maps paths relative to ``site`` (``"pkg/__init__.py"``) to source
    (dedented); ``entry_points`` maps group → entry-point name → ``"module:attr"``.
    """
    for rel, source in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
    # The file-name form of a distribution name (PEP 427): runs of -_. become _.
    dist_info = site / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {value}" for ep, value in eps.items()]
        lines.append("")
    (dist_info / "entry_points.txt").write_text("\n".join(lines))
    (dist_info / "RECORD").write_text("")
    return dist_info


def run_python(
    args: Iterable[str],
    paths: Iterable[Path],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run this interpreter with ``paths`` on ``PYTHONPATH`` and ``env`` added.

    ``ACTORLM_*`` variables of the calling process are dropped, so a test states
    every one it depends on.
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("ACTORLM_")}
    full["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, *args], env=full, capture_output=True, text=True, timeout=timeout
    )
