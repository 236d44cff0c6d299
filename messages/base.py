"""The base of every message and the table of stable tags.

A message is a frozen ``msgspec.Struct`` with a stable wire tag, declared as::

    class AddRequest(Message, frozen=True, kw_only=True):
        TAG: ClassVar[str] = "sched.add"
        rid: str

Subclassing registers the tag; two classes claiming one tag is an error at import
time. Messages are pure data: no methods beyond what msgspec gives.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

__all__ = ["Message", "message_types", "type_for_tag"]

_BY_TAG: dict[str, type[Message]] = {}


class Message(msgspec.Struct, frozen=True, kw_only=True):
    TAG: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = cls.__dict__.get("TAG", "")
        if not tag:
            return  # an abstract intermediate or a plain nested struct
        other = _BY_TAG.get(tag)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(
                f"message tag {tag!r} claimed by {other.__qualname__} and {cls.__qualname__}"
            )
        _BY_TAG[tag] = cls


def type_for_tag(tag: str) -> type[Message] | None:
    return _BY_TAG.get(tag)


def message_types() -> dict[str, type[Message]]:
    """Every registered message type by tag (import the message modules first)."""
    return dict(sorted(_BY_TAG.items()))
