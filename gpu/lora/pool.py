"""The worker's adapter slots: LoRA weights for every layer and projection, which
adapter each slot holds, and the per-step plan that says which rows use which.

Memory is fixed at start, as a GPU pool would be: ``--max-loras-per-batch`` slots of
rank R (``--max-lora-rank``) per projection and layer; an adapter of rank r fills the
first r ranks of its slot, and projections it does not target get rank 0 (skipped).
``b`` holds the scaling already (the loader folds it in). Two layouts: on CUDA the
Triton kernels' (``a`` [L, S, R, in], ``b`` [L, S, out, R]); elsewhere rank-major
(``a`` [L, R, S, in], ``b`` [L, R, S, out]): a layer's first r ranks of every slot
are the batched matrices ``ops.lora_apply_gathered`` takes as they are, without a
copy; past a slot's own rank they are zero (``load`` clears what an adapter left).
Where the native kernel builds (``kernels/lora.py``), the CPU computes each projection
in one call over the same tensors, through descriptors made once (``desc``).

Loading a slot runs beside a forward pass (another thread) and never races it: the
loader only hands out slots no running request uses, and the slot's id is cleared
before its weights change and set once the last part is in, so a step planned
meanwhile cannot find it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
from actorlm.messages.errors import ErrorCode
from actorlm.messages.step import ForwardBatch, SeqError, SeqStep

from ..kernels.lora import LORA_MAX_RANK, LoraDesc, describe, lora_apply_native, native_lora
from .batch import BASE
from .ops import LoraWeights, lora_apply_gathered, lora_apply_segments, lora_apply_triton
from .plan import LoraPlan
from .targets import LORA_MODULES, BaseShapes

__all__ = ["LoraMemoryPool"]


class LoraMemoryPool:
    def __init__(
        self,
        shapes: BaseShapes,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = shapes
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        L, S, R = shapes.num_layers, num_slots, max_rank
        self.rank_major = device.type != "cuda"
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.ranks: dict[str, list[int]] = {}  # host copy of each projection's slot ranks
        self.weights: dict[str, list[LoraWeights]] = {}  # CUDA: the kernels' views of a, b
        self._rank_t: dict[str, torch.Tensor] = {}
        ones = torch.ones(S, dtype=torch.float32, device=device)
        for m in LORA_MODULES:
            k, n = shapes.modules[m]
            dims = ((L, R, S, k), (L, R, S, n)) if self.rank_major else ((L, S, R, k), (L, S, n, R))
            self.a[m] = torch.zeros(*dims[0], dtype=dtype, device=device)
            self.b[m] = torch.zeros(*dims[1], dtype=dtype, device=device)
            self.ranks[m] = [0] * S
            self._rank_t[m] = torch.zeros(S, dtype=torch.int32, device=device)
            if not self.rank_major:
                self.weights[m] = [
                    LoraWeights(self.a[m][i], self.b[m][i], self._rank_t[m], ones) for i in range(L)
                ]
        self.slot_ids: list[str | None] = [None] * S
        self.plan: LoraPlan | None = None  # this step's, while its forward pass runs
        self._descs: dict[tuple[str, int], LoraDesc | None] = {}
        self._views: dict[tuple[str, int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.native = (
            self.rank_major
            and device.type == "cpu"
            and max_rank <= LORA_MAX_RANK
            and native_lora() is not None
            and all(self.desc(m, 0) is not None for m in LORA_MODULES)
        )

    def desc(self, module: str, layer: int) -> LoraDesc | None:
        """The native kernel's descriptor of ``module`` in ``layer`` (None: it cannot
        read these weights), made once: it points into the pool's tensors."""
        key = (module, layer)
        if key not in self._descs:
            self._descs[key] = describe(
                self.a[module][layer], self.b[module][layer], self._rank_t[module]
            )
        return self._descs[key]

    def batched(
        self, module: str, layer: int, r: int, slots: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's first ``r`` ranks of ``slots`` as batched matrices, ``a`` [n, in, r]
        and ``b`` [n, r, out]: views (made once per shape) of the rank-major weights."""
        key = (module, layer, r, slots.start, slots.stop)
        views = self._views.get(key)
        if views is None:
            a = self.a[module][layer][:r, slots].permute(1, 2, 0)
            b = self.b[module][layer][:r, slots].permute(1, 0, 2)
            views = self._views[key] = (a, b)
        return views

    def apply(
        self,
        plan: LoraPlan,
        x: torch.Tensor,
        xg: torch.Tensor | None,
        y: torch.Tensor,
        module: str,
        layer: int,
    ) -> None:
        """Add the step's deltas of ``module`` in ``layer`` to ``y`` (its output rows);
        ``xg``: ``x`` gathered by the plan, when it gathers."""
        r = plan.ranks.get(module)
        if r is None:
            return
        if plan.triton:
            lora_apply_triton(x, y, self.weights[module][layer], plan.batch)
            return
        if plan.rows is not None and self._native(x, y, plan.rows, module, layer):
            return
        if xg is not None and plan.gather is not None:
            g = plan.gather
            a, b = self.batched(module, layer, r, g.slots)
            lora_apply_gathered(xg, y[g.first :], a, b, g.valid)
        else:
            a, b = self.a[module][layer], self.b[module][layer]
            lora_apply_segments(x, y, a, b, plan.segments, self.ranks[module])

    def _native(
        self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, module: str, layer: int
    ) -> bool:
        desc = self.desc(module, layer)
        return desc is not None and lora_apply_native(x, y, desc, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.a.values(), *self.b.values()])

    def slot_of(self, lora_id: str) -> int | None:
        for i in range(len(self.slot_ids) - 1, -1, -1):
            if self.slot_ids[i] == lora_id:
                return i
        return None

    def plan_step(
        self, seqs: list[SeqStep], batch: ForwardBatch, errors: list[SeqError]
    ) -> tuple[list[SeqStep], LoraPlan | None]:
        """``seqs`` grouped by adapter slot (base first, batch order within a slot) and
        the step's plan (None: no adapter in it). A sequence whose adapter is in no slot
        is left out with an error: it is never computed with other weights."""
        from ..kernels.triton import triton_available

        if len(batch.lora_ids) != len(batch.seqs):
            raise ValueError(f"{len(batch.lora_ids)} lora_ids for {len(batch.seqs)} sequences")
        wanted = dict(zip((s.rid for s in batch.seqs), batch.lora_ids, strict=True))
        keyed: list[tuple[int, SeqStep]] = []
        for s in seqs:
            lora_id = wanted.get(s.rid, "")
            slot = self.slot_of(lora_id) if lora_id else BASE
            if slot is None:
                message = f"adapter {lora_id} is not loaded in the worker (it restarted?); retry"
                errors.append(SeqError(s.rid, message, ErrorCode.UNAVAILABLE))
                continue
            keyed.append((slot, s))
        keyed.sort(key=lambda t: t[0])
        grouped = [s for _, s in keyed]
        if all(slot == BASE for slot, _ in keyed):
            return grouped, None
        triton = self.device.type == "cuda" and triton_available()
        lens = [len(s.input_ids) for s in grouped]
        slots = [slot for slot, _ in keyed]
        plan = LoraPlan.build(
            lens, slots, self.ranks, triton=triton, native=self.native, device=self.device
        )
        return grouped, plan

    def load(
        self,
        slot: int,
        lora_id: str,
        targets: Sequence[tuple[str, np.ndarray, np.ndarray]],
        *,
        first: bool = True,
        last: bool = True,
    ) -> None:
        """Copy one part of an adapter's weights ((module, a [L, r, in], b [L, out, r]))
        into ``slot``; the slot serves ``lora_id`` once the ``last`` part is in."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (the worker has {self.num_slots})")
        checked = [self._check(m, a, b) for m, a, b in targets]
        if first:
            self.slot_ids[slot] = None  # before any weight changes: no new step finds it
            for m in LORA_MODULES:  # what the last adapter left: the batched path reads it
                if self.ranks[m][slot]:
                    a_old, b_old = self._slot(m, slot, self.ranks[m][slot])
                    a_old.zero_()
                    b_old.zero_()
                self._set_rank(m, slot, 0)
        for m, a, b in checked:
            r = a.shape[1]
            a_new, b_new = self._slot(m, slot, r)
            a_new.copy_(a)
            b_new.copy_(b if not self.rank_major else b.transpose(1, 2))
            self._set_rank(m, slot, r)
        if last:
            self.slot_ids[slot] = lora_id

    def _slot(self, m: str, slot: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``slot``'s first ``r`` ranks: ``a`` [L, r, in]; ``b`` [L, r, out]
        rank-major, else [L, out, r]."""
        if self.rank_major:
            return self.a[m][:, :r, slot], self.b[m][:, :r, slot]
        return self.a[m][:, slot, :r], self.b[m][:, slot, :, :r]

    def _check(
        self, m: str, a: np.ndarray, b: np.ndarray
    ) -> tuple[str, torch.Tensor, torch.Tensor]:
        if m not in self.a:
            raise ValueError(f"unknown LoRA target {m!r}; known: {', '.join(LORA_MODULES)}")
        k, n = self.shapes.modules[m]
        L, R = self.shapes.num_layers, self.max_rank
        r = a.shape[1] if a.ndim == 3 else -1
        if a.shape != (L, r, k) or b.shape != (L, n, r) or not 0 < r <= R:
            raise ValueError(
                f"{m}: A {list(a.shape)} and B {list(b.shape)} do not fit [{L}, r<={R}, {k}] "
                f"and [{L}, {n}, r]"
            )
        with warnings.catch_warnings():  # arrays over received frames are read-only: we only read
            warnings.simplefilter("ignore", UserWarning)
            ta, tb = torch.from_numpy(np.asarray(a)), torch.from_numpy(np.asarray(b))
        return m, ta.to(self.dtype, copy=False), tb.to(self.dtype, copy=False)

    def _set_rank(self, m: str, slot: int, r: int) -> None:
        self.ranks[m][slot] = r
        self._rank_t[m][slot] = r

    def clear(self) -> None:
        """Every slot free (the loader that filled them is gone)."""
        self.slot_ids = [None] * self.num_slots
