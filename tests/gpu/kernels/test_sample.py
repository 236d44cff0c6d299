"""The sampling kernel (gpu/kernels/sample.py) against the filtered softmax computed in
float64: each ISA build draws, at a uniform inside each kept token's share of the
kept mass, that token, and never a token the filters drop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from actorlm.gpu.kernels import sample

from .levels import LEVELS

pytestmark = pytest.mark.skipif(sample.native_sample() is None, reason="no C compiler here")

VOCAB = 49_152  # the default model's: blocks of the running sums, vectors and a tail


def _expected(z: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """Each token's probability after the filters (float64): temperature, top-k, top-p
    over the renormalized top-k (the smallest heaviest prefix reaching p), min-p."""
    w = np.exp((z - z.max()) / t)
    keep = np.argsort(-w, kind="stable")
    keep = keep[w[keep] > 0]
    if 0 < k < len(z):
        keep = keep[:k]
    if p < 1:
        before = np.cumsum(w[keep]) - w[keep]
        keep = keep[before < p * w[keep].sum()]
    keep = keep[w[keep] >= min_p]  # the heaviest weighs 1
    out = np.zeros(len(z))
    out[keep] = w[keep] / w[keep].sum()
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "t,k,p,min_p",
    [
        (1.0, 0, 1.0, 0.0),  # temperature alone
        (0.6, 0, 1.0, 0.02),  # min-p alone: a floor
        (1.0, 50, 1.0, 0.0),  # top-k
        (0.8, 0, 0.9, 0.0),  # top-p over the whole vocabulary
        (1.2, 400, 0.8, 0.0),  # top-p over the renormalized top-k
        (0.9, 40, 0.95, 0.1),  # all three
        (3.0, 0, 0.5, 0.0),  # a flat row: a nucleus of thousands
        (1.0, 7, 0.7, 0.0),  # ties at the top-k and top-p boundaries
    ],
)
def test_draws_follow_the_filtered_softmax(
    level: str, t: float, k: int, p: float, min_p: float
) -> None:
    """N uniforms evenly spread over [0, 1) land on each token about N times its
    probability (within one: the inverse CDF, whatever order the kernel keeps). Which of
    equal logits a cut keeps is the kernel's choice (a sort's too): tokens of one logit
    are counted together."""
    g = torch.Generator().manual_seed(int(t * 10) + k)
    if k == 7:  # logits of a few values only: many equal weights
        x = torch.randint(0, 6, (1, VOCAB), generator=g).float()
    else:
        x = (torch.randn(1, VOCAB, generator=g, dtype=torch.float64) * 2.5).float()
    x[0, 17] = x[0, 1000] = float("-inf")  # banned: never drawn
    probs = _expected(x[0].double().numpy(), t, k, p, min_p)
    n = 2000
    out = sample.sample_rows(x, [0] * n, [t] * n, [k] * n, [p] * n, [min_p] * n,
                             [(i + 0.5) / n for i in range(n)], level)  # fmt: skip
    assert out is not None
    values, cls = np.unique(x[0].numpy(), return_inverse=True)
    counts = np.bincount(cls[out], minlength=len(values))
    want = np.bincount(cls, weights=probs, minlength=len(values)) * n
    assert counts[want == 0].sum() == 0
    assert np.abs(counts - want).max() <= 1.0 + 1e-3 * n, np.abs(counts - want).max()


@pytest.mark.parametrize("level", LEVELS)
def test_rows_nan_inf_and_banned(level: str) -> None:
    """A NaN row answers its first NaN and a row of -inf 0 (torch.argmax's picks); +inf
    wins where it is; a row with one token left draws it at every uniform; rows are
    read where ``rows`` points, with a stride."""
    x = torch.randn(5, 300, dtype=torch.float64).float()
    x[0, 7] = x[0, 9] = float("nan")
    x[1] = float("-inf")
    x[2, 11] = float("inf")
    x[3] = float("-inf")
    x[3, 123] = 0.5
    wide = torch.randn(5, 320)
    wide[:, :300] = x
    view = wide[:, :300]  # row stride 320
    for u in (0.0, 0.5, 0.999999):
        out = sample.sample_rows(
            view, [0, 1, 2, 3], [1.0] * 4, [0] * 4, [0.9] * 4, [0.0] * 4, [u] * 4, level
        )
        assert out == [7, 0, 11, 123]
    # rows in any order, each with its own settings
    out = sample.sample_rows(
        view,
        [4, 3, 4],
        [1e-4, 1.0, 1.0],
        [0, 1, 0],
        [1.0, 1.0, 1.0],
        [0.0] * 3,
        [0.3, 0.7, 0.99],
        level,
    )
    assert out is not None and out[0] == int(view[4].argmax()) and out[1] == 123


def test_refuses_what_it_cannot_read() -> None:
    """Half precision or a transposed view go to PyTorch (None)."""
    x = torch.randn(2, 64)
    args = ([0], [1.0], [0], [1.0], [0.0], [0.5])
    assert sample.sample_rows(x.half(), *args) is None
    assert sample.sample_rows(x.t(), *args) is None
    assert sample.sample_rows(x, *args) is not None


def test_refuses_rows_it_would_read_out_of_bounds() -> None:
    """A row index outside ``x`` or a temperature of 0 (a greedy row: argmax) is an
    error, not a read past the tensor."""
    x = torch.randn(2, 64)
    with pytest.raises(ValueError):
        sample.sample_rows(x, [2], [1.0], [0], [1.0], [0.0], [0.5])
    with pytest.raises(ValueError):
        sample.sample_rows(x, [0], [0.0], [0], [1.0], [0.0], [0.5])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", [0, 1, 20])
def test_logprobs_match_log_softmax(level: str, k: int) -> None:
    """Each row's chosen token's log-probability and its k best (ids and values, largest
    first) against log_softmax in float64; rows read where ``rows`` points, with a row
    stride; -inf logits are -inf; of equal logits the first ids are the best ones."""
    g = torch.Generator().manual_seed(k)
    wide = (torch.randn(4, VOCAB + 40, generator=g, dtype=torch.float64) * 4).float()
    x = wide[:, :VOCAB]  # row stride VOCAB + 40
    x[1, :] = torch.randint(0, 5, (VOCAB,), generator=g).float()  # ties everywhere
    x[2, 100] = x[2, 3] = float("-inf")
    x[3, -1] = 60.0  # the best at the very end: the tail's
    rows, tokens = [3, 1, 2, 0, 2], [VOCAB - 1, 7, 100, 12, 5]
    got = sample.logprob_rows(x, rows, tokens, k, level)
    assert got is not None
    ref = torch.log_softmax(x.double(), -1)
    want = ref[rows, tokens].numpy()
    assert got.chosen[2] == -np.inf
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(got.chosen)[finite], want[finite], atol=2e-5)
    for j, r in enumerate(rows):
        order = np.lexsort((np.arange(VOCAB), -x[r].numpy()))[:k]  # value desc, id asc
        assert got.top_ids[j] == order.tolist()
        np.testing.assert_allclose(got.top_vals[j], ref[r, order].numpy(), atol=2e-5)


@pytest.mark.parametrize("level", LEVELS)
def test_logprobs_leave_nan_and_sparse_rows_to_torch(level: str) -> None:
    """A row with a NaN, one with no finite maximum (+inf, or all -inf), and one with
    fewer than k values above -inf answer None (torch's NaNs and ties then); without a
    top a row of two finite values is answered."""
    x = torch.randn(5, 300)
    x[0, 9] = float("nan")
    x[1, 4] = float("inf")
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, 5] = x[3, 6] = 1.0
    for r in range(4):
        assert sample.logprob_rows(x, [4, r], [0, 5], 3, level) is None
    got = sample.logprob_rows(x, [3], [5], 2, level)
    assert got is not None and got.top_ids == [[5, 6]]
    np.testing.assert_allclose(got.top_vals, [[np.log(0.5)] * 2], atol=1e-6)
    assert got.chosen == pytest.approx([np.log(0.5)], abs=1e-6)


def test_logprobs_refuse_what_they_cannot_read() -> None:
    """Half precision or a transposed view go to torch (None); a row, token or k outside
    the logits is an error, not a read past the tensor."""
    x = torch.randn(2, 64)
    assert sample.logprob_rows(x.half(), [0], [0], 1) is None
    assert sample.logprob_rows(x.t(), [0], [0], 1) is None
    for rows, tokens, k in (([2], [0], 1), ([0], [64], 1), ([0], [-1], 1), ([0], [0], 65)):
        with pytest.raises(ValueError):
            sample.logprob_rows(x, rows, tokens, k)
