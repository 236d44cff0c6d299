"""Per-step forward metadata: what the model and attention backend need to know
about a ragged batch, as tensors, built once per step and reused by every layer.

Tokens of all sequences are packed back to back (no padding): sequence ``i``
owns rows ``row_starts[i] : row_starts[i] + extend_lens[i]`` of the packed batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["ForwardMeta", "SeqSpec"]


@dataclass(frozen=True)
class SeqSpec:
    """One sequence's share of a step, free of messaging types."""

    input_ids: Sequence[int]
    start_pos: int  # tokens already in the KV cache
    page_ids: Sequence[int]  # covers start_pos + len(input_ids) tokens
    sample: bool = True  # compute logits for the last token
    # The whole prompt's length (0: unknown). A chunk of a prompt reads RoPE as the
    # whole prompt would: LongRoPE picks its factors by a sequence's length.
    prompt_len: int = 0


@dataclass
class ForwardMeta:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, flat KV slot each new token is written to
    sample_rows: torch.Tensor  # [S] int64, rows whose logits are wanted (batch order)
    start_pos: list[int]
    extend_lens: list[int]
    row_starts: list[int]
    page_tables: list[list[int]]
    page_size: int
    max_seq_len: int  # longest start_pos + extend_len in the batch
    # The model's attention layout, the same every step: per-layer window in tokens
    # (0 = full attention; empty = every layer full) and Gemma 2's logit soft cap (0 =
    # none). A query at position p sees keys p - window < j <= p, as transformers does.
    layer_windows: Sequence[int] = ()
    logit_softcap: float = 0.0
    seq_lens: list[int] = field(default_factory=list)  # max(start_pos + extend_len, prompt_len)
    attn: Any = field(default=None)  # the backend's own per-step state (init_forward_metadata)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSpec],
        page_size: int,
        device: torch.device | str = "cpu",
        layer_windows: Sequence[int] = (),
        logit_softcap: float = 0.0,
    ) -> ForwardMeta:
        # numpy for the index arithmetic: a Python loop per token costs ~1 µs each.
        ids: list[int] = []
        starts = [s.start_pos for s in seqs]
        lens = [len(s.input_ids) for s in seqs]
        row_starts = (
            np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64).tolist() if seqs else []
        )
        positions = np.empty(sum(lens), dtype=np.int64)
        slots = np.empty(sum(lens), dtype=np.int64)
        sample_rows: list[int] = []
        max_seq_len = 0
        for s, r0, n in zip(seqs, row_starts, lens, strict=True):
            if n == 0:
                raise ValueError("a sequence step needs at least one input token")
            end = s.start_pos + n
            needed = -(-end // page_size)
            if len(s.page_ids) < needed:
                raise ValueError(f"page table of {len(s.page_ids)} pages cannot hold {end} tokens")
            ids.extend(s.input_ids)
            pos = np.arange(s.start_pos, end, dtype=np.int64)
            positions[r0 : r0 + n] = pos
            pages = np.asarray(s.page_ids[:needed], dtype=np.int64)
            slots[r0 : r0 + n] = pages[pos // page_size] * page_size + pos % page_size
            if s.sample:
                sample_rows.append(r0 + n - 1)
            max_seq_len = max(max_seq_len, end)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(positions).to(device),
            out_cache_loc=torch.from_numpy(slots).to(device),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
            start_pos=starts,
            extend_lens=lens,
            row_starts=row_starts,
            page_tables=[list(s.page_ids) for s in seqs],
            page_size=page_size,
            max_seq_len=max_seq_len,
            seq_lens=[max(a + n, s.prompt_len) for a, n, s in zip(starts, lens, seqs, strict=True)],
            layer_windows=tuple(layer_windows),
            logit_softcap=logit_softcap,
        )
