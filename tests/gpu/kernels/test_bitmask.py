"""The bitmask kernels of gpu/kernels/bitmask.py against the PyTorch path they replace
(unpack the words, fill a copy with -inf, torch.argmax)."""

from __future__ import annotations

import pytest
import torch
from actorlm.gpu.kernels import bitmask

pytestmark = pytest.mark.skipif(bitmask.native_bitmask() is None, reason="no C compiler here")


def _case(
    rows: int, vocab: int, words: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Logits with ties, NaNs and -infs, and packed masks: dense, sparse, empty, full,
    a row with none (free), and one allowing only tokens whose logit is -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # many ties
    x[0, 5] = x[1, vocab - 1] = float("nan")
    x[2, :] = float("-inf")
    x[3, ::7] = float("inf")
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    packed[4] = 0  # nothing allowed
    packed[5] = -1  # everything allowed (past the mask's end: banned)
    packed[6, 1:] = 0  # a few tokens of the first word only
    masks: list[torch.Tensor | None] = [packed[r] for r in range(rows)]
    masks[7] = None
    x[8] = torch.where(torch.rand(vocab, generator=g) < 0.5, float("-inf"), 1.0)
    masks[8] = packed[8] & 0  # allowed tokens only where...
    inf_ids = (x[8] == float("-inf")).nonzero().flatten()[:5].tolist()
    for t in inf_ids:  # ...the logit is -inf: torch's pick is 0, banned or not
        if t < 32 * words:
            masks[8][t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return x, masks


def _reference(x: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
    rows = [i for i, m in enumerate(masks) if m is not None]
    return bitmask.masked_logits(x, rows, [m for m in masks if m is not None])


@pytest.mark.parametrize(
    ("rows", "vocab", "words"),
    [(12, 320, 10), (16, 100, 3), (9, 70, 3), (40, 4099, 129), (10, 96, 2)],
)
def test_masked_argmax_is_torch_argmax_of_the_masked_logits(
    rows: int, vocab: int, words: int
) -> None:
    """Ties (first maximum), NaN (the first one wins), -inf rows, a vocab not a multiple
    of 32, masks shorter and longer than the vocab, free rows beside masked ones."""
    x, masks = _case(rows, vocab, words, seed=vocab)
    assert bitmask._pointers(x, masks) is not None  # the kernel, not the fallback
    want = _reference(x, masks).argmax(dim=-1)
    before = x.clone()
    got = bitmask.masked_argmax(x, masks)
    assert torch.equal(got, want)
    assert torch.equal(x.nan_to_num(), before.nan_to_num())  # untouched
    free = bitmask.masked_argmax(x, [None] * rows)  # the free rows' pick, alone
    assert torch.equal(free, x.argmax(dim=-1))


def test_masked_argmax_reads_strided_rows() -> None:
    base, masks = _case(12, 400, 10, seed=3)
    x = base[:, 40:360]  # row stride 400, 320 tokens
    assert bitmask._pointers(x, masks) is not None
    assert torch.equal(bitmask.masked_argmax(x, masks), _reference(x, masks).argmax(dim=-1))


@pytest.mark.parametrize(("rows", "vocab", "words"), [(12, 320, 10), (9, 70, 3), (10, 96, 2)])
def test_apply_masks_in_place_is_the_masked_copy(rows: int, vocab: int, words: int) -> None:
    x, masks = _case(rows, vocab, words, seed=rows)
    given = {i: m for i, m in enumerate(masks) if m is not None}
    want = _reference(x, masks)
    y = x.clone()
    out = bitmask.apply_masks_(y, given)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)


def test_what_the_kernels_cannot_take_goes_the_pytorch_way() -> None:
    """Bool masks, masks of two widths, bf16 logits: the PyTorch path, same answers."""
    x, masks = _case(10, 96, 3, seed=1)
    bools: list[torch.Tensor | None] = [
        None if m is None else ~bitmask.banned([m], 96, x.device)[0] for m in masks
    ]
    assert bitmask._pointers(x, bools) is None
    want = _reference(x, masks).argmax(dim=-1)
    assert torch.equal(bitmask.masked_argmax(x, bools), want)
    widths = [*masks[:9], masks[9][:2]]  # type: ignore[index]
    assert bitmask._pointers(x, widths) is None
    assert torch.equal(bitmask.masked_argmax(x, widths), _reference(x, widths).argmax(dim=-1))
    assert bitmask._pointers(x.bfloat16(), masks) is None
