"""The general plugin of the example platform's distribution.

actorlm runs it only when ``example_device`` is the active platform; otherwise it
is skipped without being imported.
"""

from __future__ import annotations

from actorlm.extensions.points import ATTENTION_BACKENDS

from .record import record

__all__ = ["register"]

record("extras.imported")


def register() -> None:
    record("extras.register")
    ATTENTION_BACKENDS.register(
        "example_device_attention",
        "actorlm_example_platform.attention:DeviceAttention",
        help="the example device's kernels",
    )
