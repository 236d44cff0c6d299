"""scheduler ⇄ worker: one ForwardBatch in and one StepResult out per forward step."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from .base import Message
from .errors import ErrorCode
from .sampling import SamplingParams

__all__ = [
    "PENDING_TOKEN",
    "ForwardBatch",
    "KVDest",
    "PageIO",
    "SeqError",
    "SeqInit",
    "SeqResult",
    "SeqStep",
    "StepResult",
    "TopLogprob",
]


# An input token the worker fills in: the one this sequence sampled in the step before
# (overlap scheduling sends a step before the previous one's tokens are back).
PENDING_TOKEN = -1


class SeqInit(msgspec.Struct, frozen=True, kw_only=True):
    """Sent with a sequence's first step (and again after a retraction re-admits it).

    The worker keeps per-sequence sampling state (penalty counts, seed) from this
    until the scheduler lists the rid in ``ForwardBatch.release``.
    """

    sampling: SamplingParams
    token_ids: list[int]  # every token of the sequence so far: prompt, then earlier outputs
    prompt_len: int  # token_ids[:prompt_len] is the prompt (penalties count the rest)
    eos_token_ids: list[int] = []  # banned with stop_token_ids while under min_new_tokens


class KVDest(msgspec.Struct, frozen=True, array_like=True):
    """Where a prefilled prompt's KV goes: ``worker``'s pages ``page_ids`` take the pages
    of the prompt's page table from ``start_page`` on (the decode side's cached prefix
    ends there; a multiple of the page size, so the tables line up page for page)."""

    worker: str
    page_ids: list[int]
    start_page: int


class SeqStep(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a step.

    ``input_ids`` are the tokens to compute now (a prefill chunk, or one decode
    token); ``start_pos`` tokens of this sequence are already in the KV cache;
    ``page_ids`` is the page table covering ``start_pos + len(input_ids)`` tokens.
    ``sample`` is False for a prefill chunk that is not the prompt's last. A decode's
    input may be ``PENDING_TOKEN``: the token this sequence sampled in the step before.
    """

    rid: str
    input_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool = True
    init: SeqInit | None = None
    # A prefill replica's last chunk: after the pass, its pages go to this decode worker.
    ship: KVDest | None = None


class PageIO(msgspec.Struct, frozen=True, array_like=True):
    """One KV page moved between the pool and the HiCache storage tier."""

    key: str
    page_id: int


class ForwardBatch(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "step.forward"
    step_id: int
    seqs: list[SeqStep]
    release: list[str] = []  # rids whose worker-side state can be dropped
    # Done before the forward pass, in this order: save pages to storage, then load
    # pages from it (a stored page's id may be reused by a load in the same step).
    store_pages: list[PageIO] = []
    load_pages: list[PageIO] = []
    # One adapter id per sequence ("" = the base model), or empty when no sequence of
    # the step uses an adapter. The worker refuses a sequence whose adapter is not in
    # one of its slots (it never computes with another adapter's weights).
    lora_ids: list[str] = []


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class SeqResult(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None


class SeqError(msgspec.Struct, frozen=True, array_like=True):
    """A sequence the worker could not start (its logit processors refused their
    parameters, say): it was left out of the step and ends with this error."""

    rid: str
    message: str
    code: ErrorCode = ErrorCode.INVALID_REQUEST


class StepResult(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "step.result"
    step_id: int
    results: list[SeqResult]  # one per sequence with sample=True, in batch order
    errors: list[SeqError] = []  # left out of the step: no result, no KV written
    lost_keys: list[str] = []  # HiCache pages storage could not give back (now forgotten)
    forward_ms: float = 0.0
