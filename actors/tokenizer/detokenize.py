"""Token ids → streamed text: incremental detokenization, stop strings, logprob token strings.

Pure code, no asyncio or zmq: ``TokenizerActor`` keeps one ``TextStream`` per
request and calls ``stream_batch`` once per ``TokenBatch``.

Incremental decoding uses the prefix/read offset technique. Each request keeps a
short window of ids: ``window[:read]`` were already shown, the rest are new.
The new text is ``decode(window)`` minus ``decode(window[:read])``: decoding a
little already-shown context keeps the spacing right for tokenizers that strip
a leading space from the first token (sentencepiece), and costs O(window) per
step instead of re-decoding the whole output. While the decoded window ends in
U+FFFD a character is still incomplete (byte-level BPE and byte fallback split
characters across tokens): the text before it is shown, the offsets stay, and
the character comes out once a later token completes it, or as decode shows it
when the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actorlm.messages.generate import FinishReason, TokenLogprob
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import TopLogprob

from .tokenization import TextTokenizer

__all__ = [
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "StreamText",
    "TextStream",
    "detokenize_batch",
    "stream_batch",
    "token_logprobs",
]

_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes: a window still ending "incomplete" after
# this many unread tokens holds invalid bytes, so show them as they are rather
# than let the window (and the cost per step) grow without bound.
_MAX_HELD_TOKENS = 64


class IncrementalDetokenizer:
    """One request's token ids → text deltas that add up to ``tokenizer.decode(all ids)``.

    Feed ids with ``step`` (or many requests at once with ``detokenize_batch``);
    call ``finish`` once at the end to flush held text.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        # Kept special tokens are their own text segments, joined by spaces (see TextTokenizer.decode).
        self._segment_ids = (
            tokenizer.special_ids
            if not skip_special_tokens and spaces_between_special_tokens
            else frozenset()
        )
        self._window: list[int] = []
        self._read = 0
        self._shown = 0  # chars of the unread part's text already shown (before an incomplete char)
        self._segments = 0  # segments started so far: decides whether a separator is due
        self._in_run = False  # inside a run of ordinary tokens (a segment)

    def step(self, token_ids: Sequence[int]) -> str:
        return detokenize_batch([self], [token_ids])[0]

    def finish(self) -> str:
        """Everything still held (an incomplete character comes out as U+FFFD, as in decode)."""
        return self._flush_run()

    # -- the pieces detokenize_batch drives ------------------------------------

    def _push(self, token_ids: Sequence[int]) -> str:
        """Take new ids; return text that is final already (around kept special tokens)."""
        out: list[str] = []
        for i in token_ids:
            if i in self._skip:
                continue
            if i in self._segment_ids:
                out.append(self._flush_run())
                out.append(self._separator() + self.tokenizer.token_text(i))
                continue
            if not self._in_run:
                if self._segment_ids:
                    out.append(self._separator())
                self._in_run = True
            self._window.append(i)
        return "".join(out)

    def _separator(self) -> str:
        self._segments += 1
        return " " if self._segments > 1 else ""

    def _pending(self) -> tuple[list[int], list[int]] | None:
        if len(self._window) == self._read:
            return None
        return self._window[: self._read], self._window

    def _settle(self, prefix_text: str, full_text: str, final: bool = False) -> str:
        new = full_text[len(prefix_text) :]
        held = len(self._window) - self._read
        if new.endswith(_REPLACEMENT) and not final and held <= _MAX_HELD_TOKENS:
            # Show what precedes the incomplete character; it cannot change any more.
            ready = new.rstrip(_REPLACEMENT)
            delta = ready[self._shown :]
            self._shown = max(self._shown, len(ready))
            return delta
        delta = new[self._shown :]
        # Shown ids become the next window's context; everything before them is dropped.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._shown = 0
        return delta

    def _flush_run(self) -> str:
        pending = self._pending()
        text = ""
        if pending is not None:
            prefix_text, full_text = self.tokenizer.decode_windows(pending)
            text = self._settle(prefix_text, full_text, final=True)
        self._window, self._read, self._shown, self._in_run = [], 0, 0, False
        return text


def detokenize_batch(
    detokenizers: Sequence[IncrementalDetokenizer], token_ids: Sequence[Sequence[int]]
) -> list[str]:
    """New text for each request, decoding every window in one batched call.

    All detokenizers must share one tokenizer (the actor has one).
    """
    out = [d._push(ids) for d, ids in zip(detokenizers, token_ids, strict=True)]
    pending: list[tuple[int, IncrementalDetokenizer]] = []
    windows: list[list[int]] = []
    for k, d in enumerate(detokenizers):
        p = d._pending()
        if p is not None:
            pending.append((k, d))
            windows.extend(p)
    if pending:
        texts = detokenizers[0].tokenizer.decode_windows(windows)
        for j, (k, d) in enumerate(pending):
            out[k] += d._settle(texts[2 * j], texts[2 * j + 1])
    return out


class StopStringMatcher:
    """Releases text only once it cannot be the start of a stop string.

    The held tail is the longest suffix that is a prefix of some stop, so a
    match found in ``held + new`` is the earliest one the stream can have, and
    no part of a stop string is ever released.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (
                best is None or at < best[0] or (at == best[0] and len(stop) > len(best[1]))
            ):
                best = (at, stop)
        if best is not None:
            self.matched, self._held = best[1], ""
            return buf[: best[0]]
        keep = max(self._partial_len(buf, stop) for stop in self.stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    @staticmethod
    def _partial_len(buf: str, stop: str) -> int:
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0


@dataclass(frozen=True, slots=True)
class StreamText:
    """One step of one request's text.

    ``finish_reason`` set means this is the request's last text. ``stop_string_hit``:
    a stop string ended it here, so the scheduler must be told (``FinishRequest``)
    if it is still generating.
    """

    text: str
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    stop_string_hit: bool = False


class TextStream:
    """A request's whole text side: detokenizer, stop strings, stop tokens.

    A stop token (``stop_token_ids``, or eos unless ``ignore_eos``) that ends the
    request is reported as ``matched_stop`` and never rendered, like a stop
    string (vLLM and SGLang do the same).
    """

    def __init__(self, tokenizer: TextTokenizer, sampling: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, sampling.skip_special_tokens, sampling.spaces_between_special_tokens
        )
        self.stops = StopStringMatcher(sampling.stop)
        # A constrained request stops at eos whatever ignore_eos says (its grammar ends there).
        keep_eos = not sampling.ignore_eos or sampling.constraint is not None
        eos = tokenizer.eos_token_ids if keep_eos else frozenset()
        self.stop_token_ids: frozenset[int] = frozenset(sampling.stop_token_ids) | eos
        self.finished = False

    def step(
        self, token_ids: Sequence[int], finish_reason: FinishReason | None = None
    ) -> StreamText:
        return stream_batch([self], [token_ids], [finish_reason])[0]

    def _after_decode(
        self, text: str, finish_reason: FinishReason | None, stop_token: int | None
    ) -> StreamText:
        out = self.stops.push(text)
        if self.stops.matched is None and finish_reason is not None:
            out += self.stops.push(self.detokenizer.finish())
            if self.stops.matched is None:
                out += self.stops.flush()
        if self.stops.matched is not None:
            self.finished = True
            return StreamText(out, FinishReason.STOP, self.stops.matched, stop_string_hit=True)
        if finish_reason is None:
            return StreamText(out)
        self.finished = True
        return StreamText(out, finish_reason, stop_token)


def stream_batch(
    streams: Sequence[TextStream],
    token_ids: Sequence[Sequence[int]],
    finish_reasons: Sequence[FinishReason | None],
) -> list[StreamText]:
    """One ``TokenBatch`` step for many requests; finished streams yield empty text."""
    live: list[int] = []
    ids_to_render: list[Sequence[int]] = []
    stop_tokens: list[int | None] = []
    for k, (s, ids, reason) in enumerate(zip(streams, token_ids, finish_reasons, strict=True)):
        if s.finished:
            continue
        stop_token = None
        if reason == FinishReason.STOP and ids and ids[-1] in s.stop_token_ids:
            stop_token, ids = ids[-1], ids[:-1]
        live.append(k)
        ids_to_render.append(ids)
        stop_tokens.append(stop_token)
    texts = detokenize_batch([streams[k].detokenizer for k in live], ids_to_render)
    out = [StreamText("") for _ in streams]
    for k, text, stop_token in zip(live, texts, stop_tokens, strict=True):
        out[k] = streams[k]._after_decode(text, finish_reasons[k], stop_token)
    return out


def token_logprobs(
    tokenizer: TextTokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float] | None,
    top_logprobs: Sequence[Sequence[TopLogprob]] | None = None,
) -> list[TokenLogprob] | None:
    """``TokenLogprob``s for one delta, token strings as OpenAI shows them (``token_text``)
    and their raw bytes (``token_bytes``, OpenAI's ``bytes`` field)."""
    if logprobs is None:
        return None
    tops = top_logprobs or [[] for _ in token_ids]
    ids = list(token_ids) + [t.token_id for alts in tops for t in alts]
    text = dict(zip(ids, tokenizer.token_texts(ids), strict=True))
    return [
        TokenLogprob(
            token=text[tid],
            token_id=tid,
            logprob=lp,
            top=[(text[t.token_id], t.token_id, t.logprob) for t in alts],
            raw=tokenizer.token_bytes(tid),
            top_raw=[tokenizer.token_bytes(t.token_id) for t in alts],
        )
        for tid, lp, alts in zip(token_ids, logprobs, tops, strict=True)
    ]
