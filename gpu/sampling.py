"""Batched sampling for the worker: one ``Sampler.sample`` call per forward step.

Per row, in this order (each step only runs for the rows that need it):

1. logprobs, when asked, are ``log_softmax`` of the *raw* model logits (vLLM's
   default): they describe the model, not the sampling settings;
2. repetition penalty (HF: prompt + output tokens), then frequency and presence
   penalties (OpenAI: output tokens only);
3. ``logit_bias``; then eos and stop token ids banned while fewer than
   ``min_new_tokens`` were generated (``ignore_eos`` does not change this: it only
   tells the scheduler not to stop on eos);
4. logit processors, then the vocabulary mask (grammar);
5. greedy rows take the argmax; the others divide by temperature, apply top-k,
   then top-p on the renormalized rest, then min-p, and draw: on the CPU in C
   (``kernels/sample.py``: a few passes a row, the inverse CDF at one uniform a row),
   elsewhere with PyTorch (a sort of the vocabulary, Gumbel-max).

A whole-batch greedy step with none of the above is a single argmax (grammar masks
read inside it: ``kernels.bitmask``).

Seeds: a seeded row draws its uniform (CPU) or its noise (a generator seeded so) from
(seed, tokens generated so far), so its tokens depend on neither its batch neighbours
nor on a retraction and re-admission. Parallel samples (``n > 1``) that share a seed give
equal outputs unless the scheduler gives each its own seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..messages.sampling import SamplingParams
from ..messages.step import SeqInit, SeqResult, TopLogprob
from .kernels.bitmask import apply_masks_, masked_argmax
from .kernels.sample import LogprobRows, logprob_rows, native_sample, sample_rows
from .logit_processors import LogitProcessor, build_processors

__all__ = ["Sampler"]

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit generator seed for output position ``step`` (splitmix64)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over what top-k left (renormalized), as HF and vLLM do.
    ``top_k`` is V and ``top_p`` 1 where off. Returns a new ``[R, V]`` tensor."""
    sorted_z, order = z.sort(dim=-1, descending=True)
    pos = torch.arange(z.shape[-1], device=z.device)
    sorted_z.masked_fill_(pos >= top_k.unsqueeze(-1), _NEG_INF)
    probs = sorted_z.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p; top_p == 1 keeps all, even when
    # rounding pushes the cumulative sum past 1.
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p.unsqueeze(-1) < 1)
    sorted_z.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(z).scatter_(-1, order, sorted_z)


class _Seen:
    """The tokens one penalized sequence has seen (prompt and output), each once, and how
    often each came out; arrays that grow by doubling as tokens come out."""

    def __init__(self, token_ids: Sequence[int], prompt_len: int, vocab_size: int) -> None:
        ids = np.asarray(token_ids, np.int64)
        ok = (ids >= 0) & (ids < vocab_size)  # padded vocabs: ignore, never crash
        uniq = np.unique(ids[ok])
        out = ids[prompt_len:]
        out = out[(out >= 0) & (out < vocab_size)]
        self.n = len(uniq)
        self.ids = np.zeros(max(16, 2 * self.n), np.int64)
        self.counts = np.zeros(len(self.ids), np.int32)
        self.ids[: self.n] = uniq
        np.add.at(self.counts, np.searchsorted(uniq, out), 1)
        self.at = {int(t): i for i, t in enumerate(uniq)}
        self.vocab_size = vocab_size

    def record(self, token: int) -> None:
        i = self.at.get(token)
        if i is None:
            if not 0 <= token < self.vocab_size:
                return
            if self.n == len(self.ids):
                self.ids = np.resize(self.ids, 2 * self.n)
                self.counts = np.resize(self.counts, 2 * self.n)
            i = self.at[token] = self.n
            self.ids[i], self.counts[i] = token, 0
            self.n += 1
        self.counts[i] += 1


class _PenaltyPool:
    """The tokens each penalized sequence has seen, with their output counts, one slot
    each, kept sparse: a step gathers, penalizes and writes back those tokens' logits
    alone (a few hundred a row) in one batched gather and scatter. The dense [slots, V]
    counts and masks they replace cost ~3 ms a row at a 49k vocabulary (2-core Xeon)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slots: list[_Seen | None] = []
        self._free: list[int] = []

    def alloc(self, token_ids: Sequence[int], prompt_len: int) -> int:
        if not self._free:
            self._free.append(len(self._slots))
            self._slots.append(None)
        slot = self._free.pop()
        self._slots[slot] = _Seen(token_ids, prompt_len, self.vocab_size)
        return slot

    def free(self, slot: int) -> None:
        self._slots[slot] = None
        self._free.append(slot)

    def apply(
        self,
        x: torch.Tensor,
        rows: list[int],
        slots: list[int],
        rep: list[float],
        freq: list[float],
        pres: list[float],
    ) -> None:
        """Rows ``rows`` of ``x``, in place: HF's repetition penalty on every token seen,
        OpenAI's frequency and presence penalties on the output's."""
        seen = [self._seen(s) for s in slots]
        lens = [s.n for s in seen]
        ids = np.concatenate([s.ids[: s.n] for s in seen])
        counts = np.concatenate([s.counts[: s.n] for s in seen])

        def each(values: list[float] | list[int], dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.repeat(np.asarray(values, dtype), lens)).to(x.device)

        r, c = each(rows, np.int64), torch.from_numpy(ids).to(x.device)
        n = torch.from_numpy(counts).to(x.device, x.dtype)
        z = x[r, c]
        rp = each(rep, np.float32)
        z = torch.where(z > 0, z / rp, z * rp)
        z -= each(freq, np.float32) * n + each(pres, np.float32) * (n > 0).to(z.dtype)
        x[r, c] = z

    def record(self, slots: list[int], tokens: list[int]) -> None:
        for slot, token in zip(slots, tokens, strict=True):
            self._seen(slot).record(token)

    def _seen(self, slot: int) -> _Seen:
        seen = self._slots[slot]
        assert seen is not None, f"penalty slot {slot} is free"
        return seen


@dataclass(eq=False)
class _Seq:
    params: SamplingParams
    generated: int
    processors: list[LogitProcessor]
    tokens: list[int] | None  # kept only for processors, which see the whole sequence
    min_ban: list[int]  # eos + stop ids, banned while generated < min_new_tokens
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    slot: int = -1  # penalty pool row, -1 when unpenalized
    generator: torch.Generator | None = None
    # Cached from params: sample() reads these for every row of every step.
    greedy: bool = False
    want_logprobs: bool = False
    plain: bool = False  # greedy with nothing to apply: eligible for the argmax-only path

    @property
    def banning(self) -> bool:
        return bool(self.min_ban) and self.generated < self.params.min_new_tokens


class Sampler:
    """Per-sequence sampling state plus the batched sampling step (see module doc)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seqs: dict[str, _Seq] = {}
        self._pool = _PenaltyPool(vocab_size, self.device)
        self._offer: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, rid: object) -> bool:
        return rid in self._seqs

    def add(self, rid: str, init: SeqInit) -> None:
        """(Re)start ``rid``. Its parameters were checked at the edge (``check_sampling``);
        its logit processors are built here, and ``ValueError`` says why one refused."""
        self.release(rid)
        p = init.sampling
        procs = build_processors(p.logit_processors, self.vocab_size)
        seq = _Seq(
            params=p,
            generated=len(init.token_ids) - init.prompt_len,
            processors=procs,
            tokens=list(init.token_ids) if procs else None,
            min_ban=self._min_ban(init),
            bias_ids=list(p.logit_bias),
            bias_values=[float(v) for v in p.logit_bias.values()],
        )
        if p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0:
            seq.slot = self._pool.alloc(init.token_ids, init.prompt_len)
        seq.greedy = p.greedy
        seq.want_logprobs = p.logprobs or p.top_logprobs > 0
        if p.seed is not None and not p.greedy:
            seq.generator = torch.Generator(device=self.device)
        seq.plain = p.greedy and seq.slot < 0 and not (procs or seq.bias_ids or seq.want_logprobs)
        self._seqs[rid] = seq

    def _min_ban(self, init: SeqInit) -> list[int]:
        if init.sampling.min_new_tokens <= 0:
            return []
        stops = {*init.eos_token_ids, *init.sampling.stop_token_ids}
        return sorted(t for t in stops if 0 <= t < self.vocab_size)

    def argmax_only(self, rids: list[str]) -> bool:
        """Whether ``sample`` takes these rows' argmax and nothing else (greedy, with nothing
        to apply), so that a step may find it as it makes the logits (``offer_argmax``).
        Never where ``sample`` is hooked or overridden: that code sees the logits first."""
        if type(self).sample is not _OWN_SAMPLE:
            return False
        seqs = [self._seqs.get(rid) for rid in rids]
        return all(s is not None and s.plain and not s.banning for s in seqs)

    def offer_argmax(self, logits: torch.Tensor, picks: torch.Tensor) -> None:
        """``picks``: the argmax of each row of ``logits`` (``torch.argmax``'s), found by
        the step that made them (the fused decode step, in its own threads' caches). The
        next ``sample`` of these very logits without masks takes them instead of reading
        the logits again."""
        self._offer = (logits, picks)

    def release_all(self) -> None:
        for rid in list(self._seqs):
            self.release(rid)

    def release(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None and seq.slot >= 0:
            self._pool.free(seq.slot)

    def _lookup(self, rids: list[str], logits: torch.Tensor) -> list[_Seq]:
        try:
            seqs = [self._seqs[rid] for rid in rids]
        except KeyError as e:
            raise KeyError(f"no sampling state for rid {e.args[0]!r}; add() it first") from None
        if logits.dim() != 2 or logits.shape[0] != len(rids) or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} is not ({len(rids)} rids, {self.vocab_size})"
            )
        return seqs

    def sample(
        self, rids: list[str], logits: torch.Tensor, masks: dict[int, torch.Tensor] | None = None
    ) -> list[SeqResult]:
        """Sample one token per row and record it in that sequence's state.

        ``logits`` is ``[B, V]`` with row i for ``rids[i]``; it is not modified.
        ``masks`` maps a row index to that row's allowed tokens: bool ``[V]`` (True: may
        sample) or a packed int32 ``[ceil(V/32)]`` bitmask (see ``kernels.bitmask``).
        """
        seqs = self._lookup(rids, logits)
        offer, self._offer = self._offer, None  # this step's, or none: never kept past it
        if not rids:
            return []
        if all(s.plain and not s.banning for s in seqs):
            # The common case: 1 kernel, 1 sync. Grammar masks are read where the argmax
            # compares (no masked copy of the batch); on the CPU the C argmax serves
            # free and masked rows alike (~10x torch.argmax's speed, the same picks).
            if offer is not None and not masks and offer[0] is logits:
                argmax: list[int] = offer[1].tolist()  # found where the logits were made
            else:
                row_masks = (
                    [masks.get(i) for i in range(len(rids))] if masks else [None] * len(rids)
                )
                argmax = masked_argmax(logits, row_masks).tolist()
            for s in seqs:
                s.generated += 1
            return [SeqResult(rid, tok) for rid, tok in zip(rids, argmax, strict=True)]

        lp_idx = [i for i, s in enumerate(seqs) if s.want_logprobs]
        # rows with nothing to apply read the logits as they are: no [B, V] copy
        applies = masks or any(s.slot >= 0 or s.bias_ids or s.banning or s.processors for s in seqs)
        x = self._process(seqs, logits, masks or {}) if applies else logits.float()

        rand_idx = [i for i, s in enumerate(seqs) if not s.greedy]
        if len(rand_idx) < len(seqs):
            tokens = masked_argmax(x, [None] * len(seqs))  # torch.argmax's picks, in C on the CPU
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        if rand_idx:
            rand_seqs = [seqs[i] for i in rand_idx]
            rand_rows = self._rows(rand_idx)
            drawn = self._draw_native(x, rand_idx, rand_seqs)
            tokens[rand_rows] = drawn if drawn is not None else self._draw(x[rand_rows], rand_seqs)

        token_list: list[int] = tokens.tolist()
        pen_idx = [i for i, s in enumerate(seqs) if s.slot >= 0]
        if pen_idx:
            self._pool.record([seqs[i].slot for i in pen_idx], [token_list[i] for i in pen_idx])
        for s, tok in zip(seqs, token_list, strict=True):
            s.generated += 1
            if s.tokens is not None:
                s.tokens.append(tok)

        results = [SeqResult(rid, tok) for rid, tok in zip(rids, token_list, strict=True)]
        if lp_idx:  # of the model's own logits, which nothing above writes to
            self._attach_logprobs(results, seqs, lp_idx, logits, token_list)
        return results

    def processed_logits(
        self, rids: list[str], logits: torch.Tensor, masks: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``logits`` after penalties, bias, min-token bans, processors and masks (before
        temperature and top-k/p), without recording anything. For tests and for
        callers that score tokens themselves (e.g. speculative verification)."""
        return self._process(self._lookup(rids, logits), logits, masks or {})

    def _rows(self, idx: list[int]) -> torch.Tensor:
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _process(
        self, seqs: list[_Seq], logits: torch.Tensor, masks: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        x = logits.float().clone()
        pen_idx = [i for i, s in enumerate(seqs) if s.slot >= 0]
        if pen_idx:
            ps = [seqs[i].params for i in pen_idx]
            self._pool.apply(
                x,
                pen_idx,
                [seqs[i].slot for i in pen_idx],
                [p.repetition_penalty for p in ps],
                [p.frequency_penalty for p in ps],
                [p.presence_penalty for p in ps],
            )

        # Every row's bias and bans go in as one scatter each, not one kernel per row.
        b_rows: list[int] = []
        b_ids: list[int] = []
        b_vals: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, s in enumerate(seqs):
            b_rows += [i] * len(s.bias_ids)
            b_ids += s.bias_ids
            b_vals += s.bias_values
            if s.banning:
                ban_rows += [i] * len(s.min_ban)
                ban_ids += s.min_ban
        if b_rows:
            rows_cols = (self._rows(b_rows), self._rows(b_ids))
            x.index_put_(rows_cols, self._floats(b_vals), accumulate=True)
        if ban_rows:
            x[self._rows(ban_rows), self._rows(ban_ids)] = _NEG_INF

        for i, s in enumerate(seqs):
            if s.processors and s.tokens is not None:
                row = x[i]
                for proc in s.processors:
                    row = proc(s.tokens, row)
                if row.data_ptr() != x[i].data_ptr():  # the processor returned a new tensor
                    x[i] = row

        return apply_masks_(x, masks) if masks else x  # x is this step's copy: in place

    def _draw_native(
        self, x: torch.Tensor, idx: list[int], seqs: list[_Seq]
    ) -> torch.Tensor | None:
        """Rows ``idx`` of ``x`` (processed logits), each sampled per its params by the C
        kernel at one uniform a row: a seeded row's from (seed, tokens generated), the
        others' from torch's generator. None where the kernel cannot take ``x``."""
        if native_sample() is None or x.device.type != "cpu":
            return None
        ps = [s.params for s in seqs]
        unseeded = sum(p.seed is None for p in ps)
        draws = iter(torch.rand(unseeded, dtype=torch.float64).tolist())
        uniforms = [  # a seeded row's: 53 well-mixed bits, a double in [0, 1)
            next(draws) if p.seed is None else (_step_seed(p.seed, s.generated) >> 10) / 2.0**53
            for s, p in zip(seqs, ps, strict=True)
        ]
        out = sample_rows(
            x,
            idx,
            [p.temperature for p in ps],
            [p.top_k for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
            uniforms,
        )
        return None if out is None else torch.tensor(out, dtype=torch.long)

    def _draw(self, z: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        """Sample each row of ``z`` ``[R, V]`` (processed logits) per its params, with
        PyTorch (the devices the C kernel does not serve, and its reference)."""
        ps = [s.params for s in seqs]
        vocab = z.shape[-1]
        z = z / self._floats([p.temperature for p in ps]).unsqueeze(-1)

        cut_idx = [i for i, p in enumerate(ps) if p.top_k > 0 or p.top_p < 1]
        if cut_idx:
            cut_rows = self._rows(cut_idx)
            top_k = self._rows([ps[i].top_k if ps[i].top_k > 0 else vocab for i in cut_idx])
            top_p = self._floats([ps[i].top_p for i in cut_idx])
            z[cut_rows] = _top_k_top_p(z[cut_rows], top_k, top_p)

        minp_idx = [i for i, p in enumerate(ps) if p.min_p > 0]
        if minp_idx:
            minp_rows = self._rows(minp_idx)
            zm = z[minp_rows]
            probs = zm.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * self._floats(
                [ps[i].min_p for i in minp_idx]
            ).unsqueeze(-1)
            z[minp_rows] = zm.masked_fill(probs < floor, _NEG_INF)

        # Gumbel-max: argmax(z - log E), E ~ Exp(1), draws exactly from softmax(z).
        noise = torch.empty_like(z).exponential_()
        for i, s in enumerate(seqs):
            if s.generator is not None and s.params.seed is not None:
                s.generator.manual_seed(_step_seed(s.params.seed, s.generated))
                # A fresh tensor (not a view of ``noise``) so the draw cannot depend on
                # where the row sits in the batch.
                noise[i] = torch.empty(vocab, device=z.device).exponential_(generator=s.generator)
        return (z - noise.clamp_min_(1e-20).log_()).argmax(dim=-1)

    def _attach_logprobs(
        self,
        results: list[SeqResult],
        seqs: list[_Seq],
        lp_idx: list[int],
        logits: torch.Tensor,
        tokens: list[int],
    ) -> None:
        """Rows ``lp_idx``'s log-probabilities under the raw ``logits``, for the chosen
        token and the top ones: in C on the CPU (two passes over a row), else torch's
        log_softmax and topk."""
        n_top = min(max(seqs[i].params.top_logprobs for i in lp_idx), logits.shape[-1])
        chosen_ids = [tokens[i] for i in lp_idx]
        got = None
        if logits.device.type == "cpu":
            fp32 = logits.dtype == torch.float32
            src = logits if fp32 else logits[self._rows(lp_idx)].float()
            got = logprob_rows(src, lp_idx if fp32 else range(len(lp_idx)), chosen_ids, n_top)
        if got is None:  # other devices and dtypes, and rows with NaN or too few finite values
            logprobs = logits[self._rows(lp_idx)].float().log_softmax(dim=-1)
            ids = torch.tensor(chosen_ids, dtype=torch.long, device=logits.device)
            top = logprobs.topk(n_top, dim=-1)  # sorted, best first
            got = LogprobRows(
                logprobs.gather(1, ids.unsqueeze(-1)).squeeze(-1).tolist(),
                top.indices.tolist(),
                top.values.tolist(),
            )
        for j, i in enumerate(lp_idx):
            n = min(seqs[i].params.top_logprobs, n_top)
            tops = (
                [
                    TopLogprob(t, v)
                    for t, v in zip(got.top_ids[j][:n], got.top_vals[j][:n], strict=True)
                ]
                if n
                else None
            )
            res = results[i]
            results[i] = SeqResult(res.rid, res.token_id, got.chosen[j], tops)


# actorlm's own ``Sampler.sample``: a plugin that hooks or overrides it gets no shortcut
_OWN_SAMPLE = Sampler.sample
