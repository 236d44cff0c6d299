"""Who is alive: each peer an actor has heard from, its incarnation, and since when.

Every actor sends a ``Heartbeat`` to each peer in its book every ``heartbeat_s``,
and any message counts as a sign of life. A peer silent for ``timeout_s`` is down;
the next message from it brings it back up. Each start of an actor has a fresh
incarnation id carried on everything it sends, so a message with a new incarnation
means the peer restarted, even if its death went unnoticed: it is down and up at
once, and whatever state it held is gone. Messages from an incarnation known dead
are stale and dropped.

Pure bookkeeping (no clock, no asyncio): the runtime passes the time in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Change", "ChangeKind", "Peer", "PeerTable"]


class ChangeKind(enum.Enum):
    UP = "up"  # first heard, or heard again after being down
    DOWN = "down"
    RESTARTED = "restarted"  # a new incarnation: the old one is dead, the new one up


@dataclass(frozen=True)
class Change:
    role: str
    kind: ChangeKind
    reason: str = ""
    incarnation: int = 0  # the peer's incarnation now (0: unknown)


@dataclass
class Peer:
    role: str
    incarnation: int = 0
    last_heard: float = 0.0
    up: bool = False  # heard from, and not silent since
    down: bool = False  # known gone (silent, or reported dead), not heard from since
    dead: set[int] = field(default_factory=set)  # incarnations known gone
    # Of those, the ones reported dead (mark_down): gone for good. The others were only
    # replaced by a newer incarnation's message: one of them speaking while its
    # successor is down was never gone.
    reported: set[int] = field(default_factory=set)


class PeerTable:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.peers: dict[str, Peer] = {}

    def _peer(self, role: str) -> Peer:
        peer = self.peers.get(role)
        if peer is None:
            peer = self.peers[role] = Peer(role)
        return peer

    def incarnation(self, role: str) -> int:
        peer = self.peers.get(role)
        return peer.incarnation if peer is not None else 0

    def is_stale(self, role: str, incarnation: int) -> bool:
        """A message from an incarnation of ``role`` that is known to be gone."""
        peer = self.peers.get(role)
        if peer is None or incarnation == 0 or incarnation not in peer.dead:
            return False
        # A successor that fell silent (a forged frame's claim, say) does not outlive
        # the incarnation it replaced on paper: that one is heard again (see heard).
        return not (peer.down and incarnation not in peer.reported)

    @property
    def down(self) -> set[str]:
        """Peers known gone (silent, or reported dead) and not heard from since."""
        return {p.role for p in self.peers.values() if p.down}

    @property
    def up(self) -> set[str]:
        return {p.role for p in self.peers.values() if p.up}

    def heard(self, role: str, incarnation: int, now: float) -> Change | None:
        """``role`` sent something; what changed (None: nothing)."""
        peer = self._peer(role)
        peer.last_heard = now
        if incarnation and peer.incarnation and incarnation != peer.incarnation:
            peer.dead.add(peer.incarnation)
            peer.dead.discard(incarnation)  # a replaced one back (is_stale let it in)
            was_down = peer.down
            peer.incarnation, peer.up, peer.down = incarnation, True, False
            if was_down:  # its death was already handled: now it is simply back
                return Change(role, ChangeKind.UP, incarnation=incarnation)
            return Change(role, ChangeKind.RESTARTED, "a new incarnation", incarnation)
        if incarnation:
            peer.incarnation = incarnation
        if peer.up:
            return None
        peer.up, peer.down = True, False
        return Change(role, ChangeKind.UP, incarnation=peer.incarnation)

    def mark_down(self, role: str, reason: str, incarnation: int = 0) -> Change | None:
        """``role`` is gone (its process exited, or it fell silent). With ``incarnation``
        that incarnation is dead for good: nothing it still has in flight counts."""
        peer = self._peer(role)
        if incarnation:
            peer.dead.add(incarnation)
            peer.reported.add(incarnation)  # gone for good: never heard again
            if peer.incarnation in (0, incarnation):
                peer.incarnation = incarnation
        if peer.down:
            return None
        peer.up, peer.down = False, True
        return Change(role, ChangeKind.DOWN, reason, peer.incarnation)

    def expire(self, now: float) -> list[Change]:
        """The peers silent for longer than the timeout: down now."""
        out = []
        for peer in self.peers.values():
            if peer.up and now - peer.last_heard > self.timeout_s:
                peer.up, peer.down = False, True
                reason = f"no message for {now - peer.last_heard:.1f}s"
                out.append(Change(peer.role, ChangeKind.DOWN, reason, peer.incarnation))
        return out

    def forgive(self, now: float) -> None:
        """Our own loop was stalled: messages may sit unread in our inbox, so restart
        every peer's silence from now rather than blame them for our lateness."""
        for peer in self.peers.values():
            peer.last_heard = max(peer.last_heard, now)
