"""An example platform plugin: ``activate()`` says whether its hardware is here.

The "hardware" is simulated by ``ACTORLM_EXAMPLE_DEVICE=1``. Keep this module
cheap: ``activate()`` runs in every actor process, before anything else.
"""

from __future__ import annotations

import os

__all__ = ["activate"]


def activate() -> str | None:
    """The platform class path when the device is present, else None."""
    if os.environ.get("ACTORLM_EXAMPLE_DEVICE") != "1":
        return None
    return "actorlm_example_platform.platform:ExampleDevicePlatform"
