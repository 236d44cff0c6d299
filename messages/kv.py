"""Prefill/decode disaggregation: a prompt computed on a prefill replica, its KV pages
shipped to the decode replica that serves the rest of the request.

The decode scheduler admits the request into its own pool (its cached prefix, plus pages
for the rest), tells its worker which pages to expect (``ExpectKV``), and hands the
request to a prefill scheduler with ``TokenizedRequest.kv_dest``. The prefill worker
computes the prompt, samples the first token and sends the pages after the cached prefix
straight to the decode worker (``KVPages``: the KV rides as raw frames, never inside
msgpack). The decode worker writes them into the pages it was told to expect and tells
its scheduler (``KVArrived``), which then decodes the request as if it had prefilled it.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Message
from .step import KVDest, TopLogprob

__all__ = ["ExpectKV", "KVArrived", "KVDest", "KVPages"]


class ExpectKV(Message, frozen=True, kw_only=True):
    """decode scheduler → its worker (a request, answered with an Ack before the prefill
    is asked for): pages of ``rid`` will arrive for ``page_ids``. Pages for a rid not
    expected, or no longer (released), are dropped, so a late transfer never writes into
    pages that went to another request."""

    TAG: ClassVar[str] = "kv.expect"
    rid: str
    page_ids: list[int]


class KVPages(Message, frozen=True, kw_only=True):
    """prefill worker → decode worker: ``kv`` holds the pages for ``page_ids`` (the
    pool's page layout, one page after another). A large prompt comes in several; the
    ``last`` carries the first output token the prefill sampled."""

    TAG: ClassVar[str] = "kv.pages"
    rid: str
    page_ids: list[int]
    kv: np.ndarray
    last: bool = True
    token_id: int = -1
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None


class KVArrived(Message, frozen=True, kw_only=True):
    """decode worker → its scheduler: every page of ``rid`` is in the pool, or, with
    ``error``, the transfer failed (the request ends; its pages go back)."""

    TAG: ClassVar[str] = "kv.arrived"
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    error: str = ""
