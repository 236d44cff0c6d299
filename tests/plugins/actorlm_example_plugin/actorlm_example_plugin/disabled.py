"""A second plugin in the same distribution, for the ``ACTORLM_PLUGINS`` allowlist:
the tests leave it out, and its record must never appear."""

from __future__ import annotations

from .record import record

__all__ = ["register"]


def register() -> None:
    record("disabled.register")
