"""``ForwardMeta.build``'s path for steps of one token a sequence (decodes, CUDA graph
replays) against its general path on the same sequences: every field equal."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from actorlm.gpu.forward_meta import ForwardMeta, SeqSpec


def decodes(n: int, page_size: int, seed: int) -> list[SeqSpec]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pos = rng.randrange(0, 300)
        pages = rng.sample(range(1000), -(-(pos + 1) // page_size) + rng.randrange(3))
        out.append(
            SeqSpec([rng.randrange(50_000)], pos, pages, sample=i % 5 != 3, prompt_len=pos + i % 3)
        )
    return out


@pytest.mark.parametrize(("n", "page_size"), [(1, 16), (7, 1), (64, 16), (33, 4)])
def test_the_decode_path_builds_what_the_general_path_does(n: int, page_size: int) -> None:
    seqs = decodes(n, page_size, seed=n)
    args = (seqs, page_size, "cpu", (0, 8), 30.0)
    fast, general = ForwardMeta._build_decodes(*args), ForwardMeta._build_ragged(*args)
    for f in dataclasses.fields(ForwardMeta):
        a, b = getattr(fast, f.name), getattr(general, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype == torch.long and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    assert ForwardMeta.build(seqs, page_size).row_starts == list(range(n))


def test_a_short_page_table_is_refused_alike() -> None:
    seqs = [SeqSpec([5], 40, [3, 9]), SeqSpec([6], 3, [1])]  # 41 tokens need 3 pages of 16
    messages = []
    for build in (ForwardMeta._build_decodes, ForwardMeta._build_ragged):
        with pytest.raises(ValueError, match="page table of 2 pages cannot hold 41 tokens") as e:
            build(seqs, 16, "cpu", (), 0.0)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
