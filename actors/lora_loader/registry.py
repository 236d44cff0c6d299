"""The adapter registry: names, ids, pins and the references requests hold.

A name maps to one :class:`LoRARef` (SGLang's name for the same idea); requests
hold references by rid, so an unload (``unregister``) hides the name at once but
keeps the adapter until its last request has released it, and a scheduler that
died (its requests with it) drops every reference at once (``release_all``).
Pure Python: no asyncio, zmq or torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .peft import AdapterWeights

__all__ = ["LoRARef", "LoRARegistry", "RegistryError", "parse_lora_spec"]

PINNED_SUFFIX = ":pinned"


class RegistryError(ValueError):
    """A load the registry refuses; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_lora_spec(spec: str) -> tuple[str, str, bool]:
    """``name=path``, ``name=path:pinned`` or a bare ``path`` (named after its folder)
    → (name, path, pinned)."""
    pinned = spec.endswith(PINNED_SUFFIX)
    body = spec.removesuffix(PINNED_SUFFIX) if pinned else spec
    name, sep, path = body.partition("=")
    if not sep:
        name, path = Path(body).name, body
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-paths {spec!r}: give name=path (or name=path:pinned)")
    return name, path, pinned


@dataclass
class LoRARef:
    name: str
    weights: AdapterWeights
    pinned: bool = False
    unloading: bool = False

    @property
    def lora_id(self) -> str:
        return self.weights.lora_id

    @property
    def path(self) -> str:
        return self.weights.path


class LoRARegistry:
    def __init__(self, max_loaded: int = 0) -> None:
        self.max_loaded = max_loaded  # 0: no limit
        self.by_name: dict[str, LoRARef] = {}
        self.by_id: dict[str, LoRARef] = {}  # unloading ones too, until released
        self.refs: dict[str, str] = {}  # rid → lora_id
        self.counts: Counter[str] = Counter()

    def check_name(self, name: str) -> None:
        """Raise (409) if ``name`` is taken."""
        if name in self.by_name:
            raise RegistryError(
                f"an adapter named {name!r} is already loaded (from "
                f"{self.by_name[name].path}); unload it first",
                409,
            )

    def add(self, ref: LoRARef) -> None:
        self.check_name(ref.name)
        other = self.by_id.get(ref.lora_id)
        if other is not None:  # the same name and bytes, still draining its last requests
            raise RegistryError(
                f"adapter {ref.name!r} is still being unloaded ({self.counts[ref.lora_id]} "
                "request(s) use it); load it again once that unload has finished",
                409,
            )
        if self.max_loaded and len(self.by_id) >= self.max_loaded:
            raise RegistryError(
                f"{len(self.by_id)} adapters are loaded, the most --max-loaded-loras "
                f"{self.max_loaded} allows; unload one first"
            )
        self.by_name[ref.name] = ref
        self.by_id[ref.lora_id] = ref

    def get(self, name: str) -> LoRARef | None:
        return self.by_name.get(name)

    def acquire(self, rid: str, name: str) -> LoRARef | None:
        """A reference to ``name`` for request ``rid``; None if no such adapter."""
        held = self.refs.get(rid)
        if held is not None:  # asked twice: still one reference
            return self.by_id[held]
        ref = self.by_name.get(name)
        if ref is None:
            return None
        self.refs[rid] = ref.lora_id
        self.counts[ref.lora_id] += 1
        return ref

    def release(self, rid: str) -> LoRARef | None:
        """Drop ``rid``'s reference; returns the adapter if that was the last reference
        to one being unloaded (the caller finishes the unload)."""
        lora_id = self.refs.pop(rid, None)
        if lora_id is None:
            return None
        self.counts[lora_id] -= 1
        if self.counts[lora_id] > 0:
            return None
        del self.counts[lora_id]
        ref = self.by_id[lora_id]
        return ref if ref.unloading else None

    def release_all(self) -> list[LoRARef]:
        """Every reference is gone (the scheduler that held them died); the adapters
        whose unload can now finish."""
        done = [self.by_id[i] for i in self.counts if self.by_id[i].unloading]
        self.refs.clear()
        self.counts.clear()
        return done

    def unregister(self, name: str) -> LoRARef | None:
        """Hide ``name`` from new requests; the adapter stays until ``in_use`` is 0."""
        ref = self.by_name.pop(name, None)
        if ref is not None:
            ref.unloading = True
        return ref

    def in_use(self, lora_id: str) -> int:
        return self.counts.get(lora_id, 0)

    def remove(self, lora_id: str) -> None:
        """Forget an unloaded adapter whose last reference is gone."""
        ref = self.by_id.pop(lora_id, None)
        assert ref is None or (ref.unloading and not self.counts.get(lora_id)), lora_id
