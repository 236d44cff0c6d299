"""Sampler: greedy, seeded reproducibility, distribution, penalties, bias, bans, logprobs, masks."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from actorlm.gpu import sampling
from actorlm.gpu.sampling import Sampler
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import SeqInit

CPU = torch.device("cpu")
# The device-sensitive tests also run on CUDA where there is one (seeded noise and the
# penalty pool's scatters take different kernels there).
DEVICES = [
    pytest.param(CPU, id="cpu"),
    pytest.param(
        torch.device("cuda"),
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=["c", "torch"])
def draw(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Rows that sample take the C kernel (the CPU's path; a test on the CPU must have
    drawn through it) or PyTorch's (other devices', and the CPU's without a compiler)."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(sampling, "native_sample", lambda level="": None)
    else:
        kernel = sampling.sample_rows
        monkeypatch.setattr(
            sampling, "sample_rows", lambda *a, **k: calls.append(1) or kernel(*a, **k)
        )
    yield str(request.param)
    params = getattr(request.node, "callspec", None)
    on_cpu = params is None or params.params.get("device", CPU) == CPU
    assert request.param == "torch" or not on_cpu or calls, "no row was drawn by the C kernel"


def init(
    prompt: list[int], outputs: list[int] | None = None, /, eos: tuple[int, ...] = (), **params: Any
) -> SeqInit:
    outputs = outputs or []
    return SeqInit(
        sampling=SamplingParams(**params),
        token_ids=prompt + outputs,
        prompt_len=len(prompt),
        eos_token_ids=list(eos),
    )


def test_greedy_is_argmax_and_logits_untouched(draw: str) -> None:
    sampler = Sampler(50, CPU)
    for i in range(6):
        kw = {"temperature": 0.0} if i % 2 else {"top_k": 1, "temperature": 0.8}
        sampler.add(f"r{i}", init([1, 2, 3], **kw))
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sampler.sample([f"r{i}" for i in range(6)], logits)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()
    assert [r.rid for r in out] == [f"r{i}" for i in range(6)]
    assert all(r.logprob is None and r.top_logprobs is None for r in out)
    # The general path (a sampled neighbour) keeps greedy rows greedy and logits intact.
    sampler.add("hot", init([1], temperature=1.0))
    big = torch.cat([logits, torch.randn(1, 50)])
    out = sampler.sample([f"r{i}" for i in range(6)] + ["hot"], big)
    assert [r.token_id for r in out[:6]] == logits.argmax(-1).tolist()
    assert torch.equal(big[:6], before)


def _run_seeded(
    sampler: Sampler, rids: list[str], target: str, steps: list[torch.Tensor]
) -> list[int]:
    """Sample ``steps`` with ``target`` somewhere in ``rids``; each row gets that step's logits."""
    got = []
    for logits_row in steps:
        batch = logits_row.expand(len(rids), -1).clone()
        others = torch.tensor([r != target for r in rids]).unsqueeze(-1)
        batch = (batch + torch.randn_like(batch) * others).to(sampler.device)
        out = sampler.sample(rids, batch)
        got.append(next(r.token_id for r in out if r.rid == target))
    return got


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_across_batch_composition_and_readmission(
    device: torch.device, draw: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(64, generator=gen) * 0.5 for _ in range(24)]
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}

    alone = Sampler(64, device)
    alone.add("x", init([5, 6], **params))
    ref = _run_seeded(alone, ["x"], "x", steps)

    crowded = Sampler(64, device)
    crowded.add("a", init([1], temperature=1.0))
    crowded.add("b", init([2], temperature=0.0))
    crowded.add("c", init([3], temperature=0.7, seed=99))
    crowded.add("x", init([5, 6], **params))
    assert _run_seeded(crowded, ["a", "b", "x", "c"], "x", steps) == ref

    # Retracted after 10 tokens, re-admitted with prompt + those outputs: same continuation.
    readmit = Sampler(64, device)
    readmit.add("x", init([5, 6], **params))
    first = _run_seeded(readmit, ["x"], "x", steps[:10])
    readmit.release("x")
    readmit.add("x", init([5, 6], first, **params))
    assert first + _run_seeded(readmit, ["x"], "x", steps[10:]) == ref

    other = Sampler(64, device)
    other.add("x", init([5, 6], **{**params, "seed": 4321}))
    assert _run_seeded(other, ["x"], "x", steps) != ref


def _expected(logits: list[float], t: float, k: int, p: float, min_p: float) -> list[float]:
    """Reference: temperature, top-k, top-p on the renormalized rest, then min-p."""
    z = [v / t for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:k] if k > 0 else order
    w = {i: math.exp(z[i]) for i in keep}
    total = sum(w.values())
    mass, kept = 0.0, []
    for i in keep:
        if mass >= p and p < 1:
            break
        kept.append(i)
        mass += w[i] / total
    top = max(w[i] for i in kept)
    kept = [i for i in kept if w[i] >= min_p * top]
    total = sum(w[i] for i in kept)
    return [w[i] / total if i in kept else 0.0 for i in range(len(z))]


def _chi2_critical(df: int) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty); the draws are seeded anyway."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "t,k,p,min_p",
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, -1, 0.8, 0.0),
        (1.0, 0, 1.0, 0.15),
        (0.9, 6, 0.9, 0.05),
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_distribution_matches_filtered_softmax(
    t: float, k: int, p: float, min_p: float, seeded: bool, draw: str
) -> None:
    torch.manual_seed(0)
    logits = [1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.0, 1.6]
    probs = _expected(logits, t, k, p, min_p)
    vocab, batch, rounds = len(logits), 2000, 5
    sampler = Sampler(vocab, CPU)
    rids = [f"r{i}" for i in range(batch)]
    counts = [0] * vocab
    for i, rid in enumerate(rids):  # a seeded row draws afresh at each step
        seed = i if seeded else None
        sampler.add(rid, init([0], temperature=t, top_k=k, top_p=p, min_p=min_p, seed=seed))
    for _ in range(rounds):
        for res in sampler.sample(rids, torch.tensor([logits] * batch)):
            counts[res.token_id] += 1
    n = batch * rounds
    assert all(counts[i] == 0 for i in range(vocab) if probs[i] == 0)
    support = [i for i in range(vocab) if probs[i] > 0]
    chi2 = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    assert chi2 < _chi2_critical(max(1, len(support) - 1)), (counts, probs)


@pytest.mark.parametrize("device", DEVICES)
def test_repetition_penalty_hand_computed(device: torch.device) -> None:
    sampler = Sampler(6, device)
    sampler.add("r", init([0, 1], [2], temperature=0.0, repetition_penalty=2.0))
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], device=device)
    got = sampler.processed_logits(["r"], logits).cpu()
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 0.25, 3.0, -2.0, 1.0]]))
    assert sampler.sample(["r"], logits)[0].token_id == 3
    # The sampled token now counts too: 3.0 / 2.
    assert sampler.processed_logits(["r"], logits)[0, 3].item() == pytest.approx(1.5)


def test_frequency_and_presence_penalties_hand_computed() -> None:
    sampler = Sampler(6, CPU)
    # Prompt tokens (4) are not penalized; outputs are 3, 3, 1.
    sampler.add(
        "r", init([3, 4], [3, 3, 1], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    )
    logits = torch.tensor([[0.0, 1.0, 0.0, 2.0, 1.5, 0.5]])
    want = torch.tensor([[0.0, 1.0 - 0.5 - 0.25, 0.0, 2.0 - 1.0 - 0.25, 1.5, 0.5]])
    assert torch.allclose(sampler.processed_logits(["r"], logits), want)
    assert sampler.sample(["r"], logits)[0].token_id == 4  # 1.5 now beats 0.75
    want[0, 4] -= 0.75
    assert torch.allclose(sampler.processed_logits(["r"], logits), want)


def test_logit_bias() -> None:
    sampler = Sampler(5, CPU)
    sampler.add("r", init([0], temperature=0.0, logit_bias={1: 3.0, 4: -100.0}))
    logits = torch.tensor([[1.0, -1.0, 0.5, 0.0, 5.0]])
    want = torch.tensor([[1.0, 2.0, 0.5, 0.0, -95.0]])
    assert torch.allclose(sampler.processed_logits(["r"], logits), want)
    assert sampler.sample(["r"], logits)[0].token_id == 1


def test_min_new_tokens_bans_eos_and_stop_ids() -> None:
    sampler = Sampler(6, CPU)
    sampler.add("r", init([0], eos=(5,), temperature=0.0, min_new_tokens=2, stop_token_ids=[4]))
    sampler.add("s", init([0], eos=(5,), temperature=1.0, min_new_tokens=2, ignore_eos=True))
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 9.0, 10.0]] * 2)
    for _ in range(2):
        r, s = sampler.sample(["r", "s"], logits)
        assert r.token_id == 2 and s.token_id != 5
    assert sampler.sample(["r"], logits[:1])[0].token_id == 5  # two generated: allowed
    # Re-admitted with two outputs already: no ban from the start.
    sampler.add(
        "r", init([0], [2, 2], eos=(5,), temperature=0.0, min_new_tokens=2, stop_token_ids=[4])
    )
    assert sampler.sample(["r"], logits[:1])[0].token_id == 5


@pytest.fixture(params=["c", "torch"])
def lp_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Log-probabilities by the C kernel (the CPU's path: a test must have used it) or by
    torch's log_softmax (other devices', NaN rows', and the CPU's without a compiler)."""
    calls = []
    kernel = sampling.logprob_rows
    if request.param == "torch":
        monkeypatch.setattr(sampling, "logprob_rows", lambda *a, **k: None)
    else:
        monkeypatch.setattr(
            sampling, "logprob_rows", lambda *a, **k: calls.append(1) or kernel(*a, **k)
        )
    yield str(request.param)
    assert request.param == "torch" or calls, "no logprobs came from the C kernel"


def test_logprobs_are_raw_and_top_sorted(lp_path: str) -> None:
    sampler = Sampler(30, CPU)
    sampler.add(
        "a", init([1], temperature=1.0, logprobs=True, top_logprobs=5, repetition_penalty=1.5)
    )
    sampler.add("b", init([1], temperature=0.0, logprobs=True))
    sampler.add("c", init([1], temperature=0.0))
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3)) * 3
    raw = torch.log_softmax(logits, -1)
    a, b, c = sampler.sample(["a", "b", "c"], logits)
    assert a.logprob == pytest.approx(raw[0, a.token_id].item(), abs=1e-5)
    assert a.top_logprobs is not None and len(a.top_logprobs) == 5
    vals, ids = raw[0].topk(5)
    assert [t.token_id for t in a.top_logprobs] == ids.tolist()
    assert [t.logprob for t in a.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-5)
    assert [t.logprob for t in a.top_logprobs] == sorted(
        (t.logprob for t in a.top_logprobs), reverse=True
    )
    assert b.logprob == pytest.approx(raw[1].max().item(), abs=1e-5) and b.top_logprobs is None
    assert c.logprob is None and c.top_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_of_half_rows_nan_rows_and_small_vocabularies(
    lp_path: str, dtype: torch.dtype
) -> None:
    """bf16 logits (a bf16 model's unfused forward) are widened first; a NaN row is
    answered as torch answers it (NaN); more top tokens asked than the vocabulary has
    give the whole vocabulary, sorted, not an error."""
    sampler = Sampler(10, CPU)
    for rid in "ab":
        sampler.add(rid, init([1], temperature=0.0, logprobs=True, top_logprobs=20))
    logits = (torch.randn(2, 10, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    a, b = sampler.sample(["a", "b"], logits)
    raw = torch.log_softmax(logits.float(), -1)
    assert a.logprob == pytest.approx(raw[0].max().item(), abs=1e-5)
    assert a.top_logprobs is not None and len(a.top_logprobs) == 10
    assert [t.token_id for t in a.top_logprobs] == raw[0].argsort(descending=True).tolist()
    assert b.top_logprobs is not None and b.top_logprobs[0].token_id == b.token_id
    logits[1, 3] = float("nan")
    _, b = sampler.sample(["a", "b"], logits)
    assert b.logprob is not None and math.isnan(b.logprob)


@pytest.mark.parametrize("device", DEVICES)
def test_masks_bool_and_packed_bitmask(device: torch.device) -> None:
    vocab = 40
    sampler = Sampler(vocab, device)
    sampler.add("g", init([0], temperature=0.0))
    sampler.add("s", init([0], temperature=1.0))
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 10.0
    allowed = [7, 33, 35]
    bool_mask = torch.zeros(vocab, dtype=torch.bool)
    bool_mask[allowed] = True
    words = [0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    packed = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    logits[0, 35] = 1.0
    for _ in range(20):
        g, s = sampler.sample(["g", "s"], logits.to(device), masks={0: bool_mask, 1: packed})
        assert g.token_id == 35 and s.token_id in allowed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [[0, 1, 2], [1]], ids=["all-rows", "one-row"])
def test_packed_bitmasks_of_a_batch_unpack_together(device: torch.device, rows: list[int]) -> None:
    """Grammar bitmasks (int32, one width) go through one unpack, the vocab padded past
    the mask's end (disallowed) and a mask wider than the vocab cut."""
    g = torch.Generator().manual_seed(0)
    for vocab in (70, 96, 100):  # masks of 3 words: 96 tokens
        sampler = Sampler(vocab, device)
        for i in range(3):
            sampler.add(f"r{i}", init([0], temperature=0.0))
        words = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=g, dtype=torch.int64)
        masks = {r: words[r].to(torch.int32) for r in rows}
        logits = torch.randn(3, vocab, generator=g)
        got = sampler.processed_logits(["r0", "r1", "r2"], logits.to(device), masks).cpu()
        for r in range(3):
            if r not in masks:
                assert torch.equal(got[r], logits[r])
                continue
            bits = [(int(masks[r][t // 32]) >> (t % 32)) & 1 if t < 96 else 0 for t in range(vocab)]
            want = logits[r].masked_fill(torch.tensor(bits) == 0, float("-inf"))
            assert torch.equal(got[r], want)


def test_release_and_unknown_rid() -> None:
    sampler = Sampler(8, CPU)
    sampler.add("r", init([0], temperature=0.5, presence_penalty=1.0))
    assert "r" in sampler and len(sampler) == 1
    sampler.release("r")
    sampler.release("r")  # idempotent
    with pytest.raises(KeyError, match="no sampling state"):
        sampler.sample(["r"], torch.zeros(1, 8))
    sampler.add("r", init([0]))
    with pytest.raises(ValueError, match="logits shape"):
        sampler.sample(["r"], torch.zeros(1, 9))
    sampler.release("r")
    for i in range(40):  # the penalty pool reuses and grows its slots
        sampler.add(f"p{i}", init([i % 8], temperature=0.0, repetition_penalty=2.0))
    out = sampler.sample([f"p{i}" for i in range(40)], torch.ones(40, 8))
    assert all(r.token_id != i % 8 for i, r in enumerate(out))


def test_an_offered_argmax_serves_the_same_logits_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's argmax, offered with its logits, is what the next greedy sample of those
    very logits returns (here a deliberately different pick, to see it taken); other
    logits, masks, or a row with something to apply read the logits. A hooked or
    overridden ``sample`` sees the logits first: no shortcut is asked for."""
    sampler = Sampler(50, CPU)
    for rid in ("a", "b"):
        sampler.add(rid, init([1], temperature=0.0))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    assert sampler.argmax_only(["a", "b"])
    sampler.offer_argmax(logits, torch.tensor([3, 4]))
    assert [r.token_id for r in sampler.sample(["a", "b"], logits)] == [3, 4]
    assert [r.token_id for r in sampler.sample(["a", "b"], logits)] == logits.argmax(-1).tolist()
    sampler.offer_argmax(logits, torch.tensor([3, 4]))
    other = logits.clone()
    assert [r.token_id for r in sampler.sample(["a", "b"], other)] == logits.argmax(-1).tolist()
    sampler.offer_argmax(logits, torch.tensor([3, 4]))
    mask = torch.zeros(2, dtype=torch.int32)
    mask[0] = 1 << 9  # token 9 alone
    out = sampler.sample(["a", "b"], logits, {0: mask})
    assert [r.token_id for r in out] == [9, int(logits[1].argmax())]

    sampler.add("c", init([1], temperature=0.0, logit_bias={2: 5.0}))
    assert not sampler.argmax_only(["a", "c"])

    class Mine(Sampler):
        def sample(self, *args: Any, **kw: Any) -> Any:
            return super().sample(*args, **kw)

    mine = Mine(50, CPU)
    mine.add("a", init([1], temperature=0.0))
    assert not mine.argmax_only(["a"])
    hooked = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a, **k: hooked(self, *a, **k))
    assert not sampler.argmax_only(["a", "b"])


def test_penalties_of_a_batch_match_the_dense_formula() -> None:
    """Penalized rows beside a plain one over 40 greedy steps (each row's seen tokens
    outgrow their first arrays), one released at step 20 and its slot taken by a new
    row, ids outside the vocabulary in a prompt: every step's processed logits are
    the formula's over the whole vocabulary (HF's repetition penalty on every token
    seen, OpenAI's frequency and presence penalties on the output's)."""
    vocab = 64
    g = torch.Generator().manual_seed(0)
    params: dict[str, dict[str, float]] = {
        "a": {"repetition_penalty": 1.3},
        "b": {"frequency_penalty": 0.4, "presence_penalty": 0.2},
        "c": {},
        "d": {"repetition_penalty": 0.8, "frequency_penalty": -0.3},
        "e": {"repetition_penalty": 1.1, "presence_penalty": 1.0},
    }
    prompts = {"a": [1, 2, 2, 70, -1], "b": [5], "c": [1], "d": list(range(30)), "e": [9, 9]}
    sampler = Sampler(vocab, CPU)
    history: dict[str, list[int]] = {}
    for rid in "abcd":
        sampler.add(rid, init(prompts[rid], temperature=0.0, **params[rid]))
        history[rid] = []
    for step in range(40):
        if step == 20:
            sampler.release("b")
            del history["b"]
            sampler.add("e", init(prompts["e"], temperature=0.0, **params["e"]))
            history["e"] = []
        rids = list(history)
        logits = torch.randn(len(rids), vocab, generator=g) * 3
        want = logits.clone()
        for i, rid in enumerate(rids):
            p = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
            p |= params[rid]
            outs = history[rid]
            for t in {*prompts[rid], *outs} & set(range(vocab)):
                z = want[i, t].item()
                z = z / p["repetition_penalty"] if z > 0 else z * p["repetition_penalty"]
                n = outs.count(t)
                want[i, t] = z - p["frequency_penalty"] * n - p["presence_penalty"] * (n > 0)
        assert torch.allclose(sampler.processed_logits(rids, logits), want, atol=1e-5), step
        for i, res in enumerate(sampler.sample(rids, logits)):
            assert res.token_id == int(want[i].argmax())
            history[rids[i]].append(res.token_id)
