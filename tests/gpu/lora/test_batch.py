"""The LoRA batch contract: segments from sequences or per-row slots, and the kernels' blocks."""

from __future__ import annotations

import numpy as np
import pytest
from actorlm.gpu.lora.batch import BASE, LoraBatch


def test_segments_from_rows_merge_runs_of_one_adapter() -> None:
    batch = LoraBatch.from_tokens([0, 0, BASE, BASE, 1, 1, 1, 0])
    assert batch.seg_indptr.tolist() == [0, 2, 4, 7, 8]
    assert batch.seg_adapter.tolist() == [0, BASE, 1, 0]
    assert batch.token_adapters().tolist() == [0, 0, BASE, BASE, 1, 1, 1, 0]
    assert batch.num_rows == 8
    assert LoraBatch.from_tokens([]).num_rows == 0


def test_segments_from_sequences_and_their_blocks() -> None:
    # a prefill of 40 rows on slot 2, a base-model decode, two decodes on slot 0
    batch = LoraBatch.from_seqs([40, 1, 1, 1], [2, BASE, 0, 0])
    adapter, row, end = batch.blocks(16)
    assert adapter.tolist() == [2, 2, 2, 0, 0]
    assert row.tolist() == [0, 16, 32, 41, 42]
    assert end.tolist() == [40, 40, 40, 42, 43]  # no block reaches past its segment
    assert all(a.dtype == np.int32 for a in (adapter, row, end))
    empty = LoraBatch.from_seqs([3, 2], [BASE, BASE]).blocks(16)
    assert all(a.size == 0 for a in empty)  # nothing to launch for base rows


def test_malformed_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="one entry more"):
        LoraBatch(np.array([0, 2], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="not decrease"):
        LoraBatch(np.array([0, 3, 2], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="slots are >= 0"):
        LoraBatch.from_seqs([1], [-2])
