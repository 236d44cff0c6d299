"""Splitting streamed text into thinking and answer, however the text is cut."""

from __future__ import annotations

import pytest
from actorlm.actors.tokenizer.reasoning import (
    ANSWER,
    THINKING,
    UNDECIDED,
    ReasoningFormat,
    ReasoningSplitter,
)
from actorlm.extensions.points import REASONING_PARSERS

QWEN3 = ReasoningFormat("qwen3")


def split(fmt: ReasoningFormat, state: str, text: str, cut: int) -> tuple[str, str]:
    """Stream ``text`` in pieces of ``cut`` characters; the joined outputs."""
    s = ReasoningSplitter(fmt, state)
    thought, answer = [], []
    for i in range(0, len(text), cut):
        r, c = s.push(text[i : i + cut])
        thought.append(r)
        answer.append(c)
    r, c = s.flush()
    return "".join(thought) + r, "".join(answer) + c


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 1000])
@pytest.mark.parametrize(
    ("state", "text", "want"),
    [
        (UNDECIDED, '<think>hmm, 2+2</think>{"a": 4}', ("hmm, 2+2", '{"a": 4}')),
        (UNDECIDED, "  <think>x</think>y", ("x", "y")),
        (UNDECIDED, '{"a": 1}', ("", '{"a": 1}')),
        (UNDECIDED, "<thinking is fun", ("", "<thinking is fun")),
        (THINKING, "so</think>done", ("so", "done")),
        (THINKING, "still thinking </thi", ("still thinking </thi", "")),
        (ANSWER, "<think>not thinking</think>", ("", "<think>not thinking</think>")),
    ],
)
def test_thinking_and_answer_split_wherever_the_text_is_cut(
    state: str, text: str, want: tuple[str, str], cut: int
) -> None:
    assert split(QWEN3, state, text, cut) == want


def test_the_prompt_decides_where_the_output_starts() -> None:
    assert QWEN3.initial_state("<|im_start|>assistant\n<think>\n") == THINKING
    assert QWEN3.initial_state("assistant\n<think>\n\n</think>\n\n") == ANSWER
    assert QWEN3.initial_state("<|im_start|>assistant\n") == UNDECIDED
    assert REASONING_PARSERS.get("deepseek-r1").initial_state("Assistant:") == THINKING
    assert {"deepseek-r1", "qwen3", "qwen3-thinking"} <= set(REASONING_PARSERS.names())
