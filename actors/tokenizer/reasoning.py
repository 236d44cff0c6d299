"""Reasoning output: a model's thinking (``<think>…</think>``) apart from its answer.

``--reasoning-parser NAME`` picks a :class:`ReasoningFormat` from the
``REASONING_PARSERS`` registry. The tokenizer splits each request's text with a
:class:`ReasoningSplitter` (OpenAI's ``reasoning_content`` beside ``content``,
streamed too), and the worker applies a request's constraint only after the
thinking ends (``actorlm.gpu.grammar.reasoner``). Both decide where thinking
starts from the prompt by the same rule (``initial_state``).

Pure code: no asyncio, zmq or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extensions.points import REASONING_PARSERS

__all__ = ["ANSWER", "THINKING", "UNDECIDED", "ReasoningFormat", "ReasoningSplitter"]

THINKING, UNDECIDED, ANSWER = "thinking", "undecided", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    think_start: str = "<think>"
    think_end: str = "</think>"
    # The output starts inside the thinking even without a start marker (DeepSeek-R1's
    # template opens it; the model writes only the end).
    forced: bool = False

    def initial_state(self, prompt_tail: str) -> str:
        """Where a request's output starts, from the end of its prompt's text: inside an
        opened think block, after a closed one, or (no marker) forced or undecided."""
        start, end = prompt_tail.rfind(self.think_start), prompt_tail.rfind(self.think_end)
        if start > end:
            return THINKING
        if end >= 0:
            return ANSWER
        return THINKING if self.forced else UNDECIDED


for _fmt in (
    ReasoningFormat("deepseek-r1", forced=True),
    ReasoningFormat("qwen3"),  # thinks only when it writes <think> (or the prompt opens it)
    ReasoningFormat("qwen3-thinking", forced=True),
):
    REASONING_PARSERS.register_builtin(_fmt.name, _fmt, help=f"{_fmt.think_start}…{_fmt.think_end}")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One request's streamed text → ``(reasoning, content)`` pieces. The markers
    themselves go to neither; text that may be the start of one is held back."""

    def __init__(self, fmt: ReasoningFormat, state: str) -> None:
        self.fmt = fmt
        self.state = state
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning, content = [], []
        while buf:
            if self.state == UNDECIDED:
                stripped = buf.lstrip()
                start = self.fmt.think_start
                if stripped.startswith(start):
                    self.state, buf = THINKING, stripped[len(start) :]
                elif start.startswith(stripped):  # all whitespace, or a start in progress
                    self._held = buf
                    break
                else:
                    self.state = ANSWER
            elif self.state == THINKING:
                at = buf.find(self.fmt.think_end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self.state, buf = ANSWER, buf[at + len(self.fmt.think_end) :]
                    continue
                keep = _partial_suffix(buf, self.fmt.think_end)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            else:
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is held at the end of the output (a marker that never completed)."""
        held, self._held = self._held, ""
        if self.state == THINKING:
            return held, ""
        return "", held
