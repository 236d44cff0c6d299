"""Metric arithmetic of the serving benchmark, free of I/O so tests can replay a stream.

Definitions (all times in seconds here, reported in milliseconds):

- TTFT: from sending the request to the first streamed chunk with non-empty text.
- ITL: the gap between two successive chunks with text (one chunk usually holds one
  token; a server that batches tokens into one chunk shows fewer, longer gaps).
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, the mean decode time per token.
- E2E: from sending the request to the end of its stream.
- output_tokens: the streamed text re-tokenized with the model's tokenizer (the
  server's ``usage`` is recorded beside it but not trusted).
- Throughput: completed requests, output tokens and prompt + output tokens, each
  divided by the wall time from the first send to the last completion.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PERCENTILES",
    "RequestResult",
    "SSEParser",
    "StreamRecorder",
    "count_output_tokens",
    "percentile",
    "replay_stream",
    "summarize",
]

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


class SSEParser:
    """Splits a byte stream into server-sent ``data:`` payloads.

    ``feed`` accepts arbitrary fragments (a line may arrive in pieces) and returns
    the payloads completed by it: parsed JSON objects, or the string ``"[DONE]"``.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any] | str]:
        self._buf += data
        out: list[dict[str, Any] | str] = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            ev = self._line(line)
            if ev is not None:
                out.append(ev)
        return out

    def close(self) -> list[dict[str, Any] | str]:
        line, self._buf = self._buf, b""
        ev = self._line(line)
        return [ev] if ev is not None else []

    @staticmethod
    def _line(raw: bytes) -> dict[str, Any] | str | None:
        line = raw.strip()
        if not line.startswith(b"data:"):
            return None  # blank separators, comments (":"), "event:" lines
        payload = line[5:].strip()
        if not payload:
            return None
        if payload == b"[DONE]":
            return "[DONE]"
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None


@dataclass
class RequestResult:
    """One request's measurements (times in seconds)."""

    prompt_tokens: int
    expected_output_tokens: int
    conversation: int = 0
    turn: int = 0
    ok: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send, for the level's time window
    end: float = 0.0
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    e2e: float = math.nan
    text: str = ""
    chunks: int = 0
    output_tokens: int = 0  # counted with the model's tokenizer
    server_output_tokens: int | None = None  # usage.completion_tokens, for reference
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def tpot(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        d["tpot"] = self.tpot
        return d


class StreamRecorder:
    """Turns timestamped SSE payloads of one streaming completion into a ``RequestResult``."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.result.start = start
        self._last: float | None = None
        self._parts: list[str] = []

    def on_event(self, ev: dict[str, Any] | str, t: float) -> None:
        if isinstance(ev, str):
            return  # [DONE]
        if "error" in ev and not ev.get("choices"):
            err = ev["error"]
            self.result.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = ev.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                self.result.server_output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.result.server_prompt_tokens = int(usage["prompt_tokens"])
        for choice in ev.get("choices") or []:
            text = choice.get("text")
            if text is None:  # chat-style delta, for servers that answer that way
                text = (choice.get("delta") or {}).get("content")
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
            if not text:
                continue
            if self._last is None:
                self.result.ttft = t - self.result.start
            else:
                self.result.itl.append(t - self._last)
            self._last = t
            self.result.chunks += 1
            self._parts.append(text)

    def finish(self, t: float, error: str = "") -> RequestResult:
        r = self.result
        r.end = t
        r.e2e = t - r.start
        r.text = "".join(self._parts)
        if error:
            r.error = error
        r.ok = not r.error and self._last is not None
        if not r.ok and not r.error:
            r.error = "empty stream"
        return r


def replay_stream(
    chunks: Iterable[tuple[float, bytes]],
    result: RequestResult,
    start: float,
    end: float | None = None,
) -> RequestResult:
    """Feed a recorded ``(time, bytes)`` stream through the same path as a live one."""
    parser = SSEParser()
    rec = StreamRecorder(result, start)
    last = start
    for t, data in chunks:
        for ev in parser.feed(data):
            rec.on_event(ev, t)
        last = t
    for ev in parser.close():
        rec.on_event(ev, last)
    return rec.finish(end if end is not None else last)


def count_output_tokens(
    results: Iterable[RequestResult], encode: Callable[[str], list[int]]
) -> None:
    """Set each result's ``output_tokens`` from its text, with the model's tokenizer."""
    for r in results:
        r.output_tokens = len(encode(r.text)) if r.text else 0


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    out: dict[str, float] = {"mean": (sum(vals) / len(vals)) * 1e3 if vals else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(vals, q) * 1e3
    return out


def summarize(results: Sequence[RequestResult], duration: float | None = None) -> dict[str, Any]:
    """The level's summary: counts, throughput, and latency stats in milliseconds.

    ``duration`` defaults to the span from the first send to the last completion.
    """
    ok = [r for r in results if r.ok]
    if duration is None:
        duration = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else 0.0
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    expected = sum(r.expected_output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": in_tok,
        "output_tokens": out_tok,
        "expected_output_tokens": expected,
        "server_output_tokens": sum(r.server_output_tokens or 0 for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tok),
        "total_throughput": per_s(in_tok + out_tok),
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats([r.tpot for r in ok]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }
