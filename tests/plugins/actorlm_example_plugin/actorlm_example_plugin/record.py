"""Leave evidence the tests can read: one line per event, naming the process.

Set ``ACTORLM_EXAMPLE_RECORD`` to a directory; each ``record(event, n)`` appends
``"<pid> <n>"`` to the file named ``event`` there. Unset, it does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["record"]


def record(event: str, n: int = 1) -> None:
    folder = os.environ.get("ACTORLM_EXAMPLE_RECORD")
    if folder:
        with open(Path(folder, event), "a") as f:
            f.write(f"{os.getpid()} {n}\n")
