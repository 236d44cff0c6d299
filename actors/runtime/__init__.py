"""The actor framework: the Actor base, its runtime (inbox, dispatch, send, request,
stream), calls in flight, transports, the launcher that supervises actors, the
child-process entry, and the public test harness. Nothing here knows what a
request or a model is."""

from .dispatch import (
    RESTARTED,
    Actor,
    ActorDied,
    ActorError,
    ActorRuntime,
    RemoteError,
    RequestTimeout,
    RuntimeOptions,
    handles,
)

__all__ = [
    "RESTARTED",
    "Actor",
    "ActorDied",
    "ActorError",
    "ActorRuntime",
    "RemoteError",
    "RequestTimeout",
    "RuntimeOptions",
    "handles",
]
