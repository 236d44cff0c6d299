"""Control conversation: lifecycle, liveness, stats and errors (any actor ⇄ supervisor/clients)."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Message
from .errors import CallErrorCode

__all__ = [
    "Ack",
    "DrainReplica",
    "ErrorReply",
    "FlushCache",
    "GetInfo",
    "GetStats",
    "Heartbeat",
    "Info",
    "PeerDown",
    "PeerUp",
    "Ping",
    "Pong",
    "Ready",
    "RestartMembers",
    "Shutdown",
    "Stats",
    "StopDeployment",
]


class Ready(Message, frozen=True, kw_only=True):
    """actor → supervisor once ``on_start`` has finished."""

    TAG: ClassVar[str] = "ctl.ready"
    role: str
    pid: int
    address: str
    info: dict[str, Any] = {}
    incarnation: int = 0


class Heartbeat(Message, frozen=True, kw_only=True):
    """actor → every peer in its book, every ``heartbeat_s``: I am alive (any message
    says so too; this one says it when there is nothing else to send)."""

    TAG: ClassVar[str] = "ctl.heartbeat"
    role: str
    pid: int


class PeerDown(Message, frozen=True, kw_only=True):
    """supervisor → everyone: ``role`` died (its process exited, or it hung and was
    killed); fail what is pending on it now. ``incarnation`` is the dead one's."""

    TAG: ClassVar[str] = "ctl.peer_down"
    role: str
    reason: str
    incarnation: int = 0


class PeerUp(Message, frozen=True, kw_only=True):
    """supervisor → everyone: ``role`` is back (restarted) at ``address``."""

    TAG: ClassVar[str] = "ctl.peer_up"
    role: str
    address: str
    incarnation: int = 0


class Shutdown(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.shutdown"
    reason: str = ""


class StopDeployment(Message, frozen=True, kw_only=True):
    """member → supervisor: stop the whole deployment as SIGTERM would (the gateway's
    ``POST /drain``): the gateway drains first, then every actor stops."""

    TAG: ClassVar[str] = "ctl.stop_deployment"
    reason: str = ""


class RestartMembers(Message, frozen=True, kw_only=True):
    """member → supervisor (a request, answered with an Ack once every role is back
    up, or with ``ok=False`` saying why not): stop ``roles`` and start them again at
    once, as a planned restart (no backoff, not counted against ``--max-restarts``).
    The gateway's ``POST /drain_replica`` restarts a drained replica this way."""

    TAG: ClassVar[str] = "ctl.restart_members"
    roles: list[str]
    reason: str = ""


class DrainReplica(Message, frozen=True, kw_only=True):
    """client → tokenizer (a request, answered with an Info whose ``values`` hold the
    replica's ``load``): the router sends ``replica`` nothing new while ``drain`` (its
    requests in flight go on), and takes it back when ``drain`` is False."""

    TAG: ClassVar[str] = "ctl.drain_replica"
    replica: int
    drain: bool = True


class Ping(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.ping"
    payload: bytes = b""


class Pong(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.pong"
    payload: bytes = b""


class GetStats(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.get_stats"


class Stats(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.stats"
    role: str
    values: dict[str, Any]


class GetInfo(Message, frozen=True, kw_only=True):
    """Ask an actor what it serves (the worker answers with the model's facts)."""

    TAG: ClassVar[str] = "ctl.get_info"


class Info(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.info"
    role: str
    values: dict[str, Any]


class FlushCache(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.flush_cache"


class Ack(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "ctl.ack"
    ok: bool = True
    detail: str = ""


class ErrorReply(Message, frozen=True, kw_only=True):
    """The reply to a request (or a rejected send) that failed.

    ``code`` says how it failed (on the wire: the member's string, such as
    ``actor_died``); ``status`` is an HTTP-like status the gateway can pass on.
    """

    TAG: ClassVar[str] = "ctl.error"
    code: CallErrorCode
    message: str
    status: int = 500
