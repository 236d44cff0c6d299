"""The scheduler's side of LoRA: which requests hold an adapter reference, which are
waiting for one, and what the next ``LoraStep`` to the lora_loader says.

A request naming an adapter (``lora_path``) waits here until the loader has
resolved the name to an id and taken a reference for it; it then joins the
planner's queue with ``lora_id`` set, and is admitted once its adapter is in a
worker slot (``ready``, which the planner reads). Its reference is released when
it has left the planner for good (finished, failed, aborted: ``sweep``). A step is
only sent when something changed: references to take or drop, the adapters waiting
and running requests need, or the loader saying its slots changed. Pure Python
over message structs: no asyncio, zmq or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from ...messages.generate import TokenizedRequest
from ...messages.lora import LoraAcquire, LoraRefused, LoraStep, LoraStepResult

__all__ = ["AdapterGate", "Waiting"]

Waiting = tuple[TokenizedRequest, str]  # the request and the role its outputs go to


class _Queued(Protocol):
    @property
    def request(self) -> TokenizedRequest: ...
    @property
    def seq(self) -> int: ...


class AdapterGate:
    def __init__(self) -> None:
        self.pending: dict[str, Waiting] = {}  # to acquire with the next step
        self.sent: dict[str, Waiting] = {}  # acquire in flight
        self.held: dict[str, str] = {}  # rid → lora_id: the loader holds a reference
        self.releases: list[str] = []
        self.ready: set[str] = set()  # adapters in a worker slot, as the loader last said
        self.dirty = False  # the loader's slots changed since its last answer
        self._last: tuple[list[str], list[str]] | None = None  # (wanted, in_use) last sent

    def add(self, msg: TokenizedRequest, reply_to: str) -> None:
        self.pending[msg.rid] = (msg, reply_to)

    def abort(self, rid: str) -> Waiting | None:
        """Forget a request that has not joined the planner yet (an acquire in flight is
        released when its answer comes); the request, if it was waiting here."""
        got = self.pending.pop(rid, None) or self.sent.pop(rid, None)
        if got is not None and rid in self.held:
            self.releases.append(rid)
            del self.held[rid]
        return got

    def sweep(self, live: Callable[[str], bool]) -> None:
        """Release the references of requests that ``live`` says are gone."""
        gone = [rid for rid in self.held if not live(rid)]
        for rid in gone:
            del self.held[rid]
        self.releases += gone

    def step(self, waiting: Iterable[_Queued], running: Iterable[_Queued]) -> LoraStep | None:
        """The next step for the loader, or None when nothing changed."""
        if not (self.held or self.pending or self.releases or self.dirty) and self._last == (
            [],
            [],
        ):
            return None  # no request has an adapter: nothing to look at (base traffic)
        wanted = list(
            dict.fromkeys(
                r.request.lora_id for r in sorted(waiting, key=lambda r: r.seq) if r.request.lora_id
            )
        )
        in_use = sorted({r.request.lora_id for r in running if r.request.lora_id})
        needs = (wanted, in_use)
        if not (self.pending or self.releases or self.dirty or needs != self._last):
            return None
        acquire = [LoraAcquire(rid, msg.lora_path or "") for rid, (msg, _) in self.pending.items()]
        self.sent.update(self.pending)
        self.pending = {}
        releases, self.releases = self.releases, []
        self.dirty = False
        self._last = needs
        return LoraStep(acquire=acquire, release=releases, wanted=wanted, in_use=in_use)

    def apply(
        self, result: LoraStepResult, *, worker_known: bool = True
    ) -> tuple[list[Waiting], list[tuple[Waiting, LoraRefused]]]:
        """The requests that now hold a reference (with ``lora_id`` set), and those the
        loader refused. ``worker_known``: the slots were loaded into the worker this
        scheduler talks to (else none counts as ready until the loader says again)."""
        acquired: list[Waiting] = []
        for got in result.acquired:
            waiting = self.sent.pop(got.rid, None)
            self.held[got.rid] = got.lora_id
            if waiting is None:  # aborted while the step was in flight
                continue
            msg, reply_to = waiting
            acquired.append((msgspec.structs.replace(msg, lora_id=got.lora_id), reply_to))
        refused = []
        for no in result.refused:
            waiting = self.sent.pop(no.rid, None)
            if waiting is not None:
                refused.append((waiting, no))
        self.ready = set(result.ready) if worker_known else set()
        return acquired, refused

    def failed(self) -> list[Waiting]:
        """The step did not reach the loader: its acquires end (the caller fails them)."""
        out = list(self.sent.values())
        self.sent = {}
        self._last = None
        return out

    def reset(self) -> tuple[list[Waiting], list[str]]:
        """The loader died: every reference with it. The requests that never joined the
        planner, and the rids in the planner that held a reference (both must end)."""
        waiting = [*self.pending.values(), *self.sent.values()]
        held = list(self.held)
        self.pending, self.sent, self.held = {}, {}, {}
        self.releases, self.ready, self._last, self.dirty = [], set(), None, False
        return waiting, held
