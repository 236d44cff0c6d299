"""Structured output through the whole pipeline (a tiny random Llama, actors in one
process), the same tests for each built-in grammar backend: JSON schemas validated
with jsonschema under greedy and seeded sampling, regexes fully matched, EBNF outputs
parsed, free requests in a mixed batch unchanged, bad constraints refused alone."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actorlm import Engine
from actorlm.actors.client import RequestFailed
from jsonschema import Draft202012Validator

from .structured_schemas import SCHEMAS

GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 7}
REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,5}( [A-Z][a-z]{2,5})?",
    r"#[0-9a-f]{6}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
]
# Arithmetic over small numbers: every output must be a Python expression.
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= num | "(" num ("*" num){0,2} ")"
num ::= [1-9] [0-9]{0,2}
"""


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def engine(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[Engine]:
    with Engine(
        str(tiny_llama),
        placement="inproc",
        kv_cache_gb=0.05,
        grammar_backend=request.param,
        grammar_fallback="none",  # each backend on its own
        dtype="float32",  # batch-invariant tokens (bf16 rounds differently per batch shape)
    ) as eng:
        yield eng


def backend(engine: Engine) -> str:
    return engine.config.grammar.grammar_backend


def run_all(engine: Engine, jobs: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
    """Every (prompt, sampling) at once, so they share batches; an exception in place
    of the output of a request that failed."""

    async def go() -> list[Any]:
        tasks = [engine.agenerate(prompt, params) for prompt, params in jobs]
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(go())


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_schema_gives_valid_json(engine: Engine, sampling: dict[str, Any]) -> None:
    names = list(SCHEMAS)
    jobs = [
        (
            "Answer in JSON:",
            {**sampling, "max_new_tokens": 96, "json_schema": json.dumps(SCHEMAS[n])},
        )
        for n in names
    ]
    for name, out in zip(names, run_all(engine, jobs), strict=True):
        assert not isinstance(out, BaseException), f"{name}: {out}"
        assert out.finish_reason == "stop", f"{name}: {out.text!r}"
        validator = Draft202012Validator(
            SCHEMAS[name], format_checker=Draft202012Validator.FORMAT_CHECKER
        )
        validator.validate(json.loads(out.text))
        assert out.grammar_backend == backend(engine)


def test_regexes_match_and_ebnf_outputs_parse(engine: Engine) -> None:
    jobs = [
        ("Say:", {**s, "max_new_tokens": 48, "regex": r}) for r in REGEXES for s in (GREEDY, SEEDED)
    ]
    jobs += [
        ("Compute:", {**s, "max_new_tokens": 48, "ebnf": EBNF})
        for s in (GREEDY, SEEDED, {**SEEDED, "seed": 8})
    ]
    outs = run_all(engine, jobs)
    for (_, params), out in zip(jobs, outs, strict=True):
        assert not isinstance(out, BaseException), out
        assert out.finish_reason == "stop", out.text
        if "regex" in params:
            assert re.fullmatch(params["regex"], out.text), (params["regex"], out.text)
        else:
            tree = ast.parse(out.text, mode="eval")
            assert isinstance(eval(compile(tree, "<ebnf>", "eval")), int)  # noqa: S307


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(engine: Engine) -> None:
    free = [
        ([11, 12, 13, 14], {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}),
        ([21, 22, 23], {**SEEDED, "max_new_tokens": 12, "ignore_eos": True}),
        (
            "Once upon a time",
            {"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_new_tokens": 12, "ignore_eos": True},
        ),
    ]
    alone = [engine.generate(prompt, params).token_ids for prompt, params in free]
    constrained = [
        (
            "JSON:",
            {**GREEDY, "max_new_tokens": 32, "json_schema": json.dumps(SCHEMAS["mixed-record"])},
        ),
        (
            "JSON:",
            {
                **SEEDED,
                "max_new_tokens": 32,
                "json_schema": json.dumps(SCHEMAS["array-of-objects"]),
            },
        ),
        ("Code:", {**SEEDED, "max_new_tokens": 16, "regex": REGEXES[0]}),
    ]
    outs = run_all(engine, [*constrained, *free, *constrained])
    assert [o.token_ids for o in outs[3:6]] == alone
    assert all(o.grammar_backend == backend(engine) for o in outs[:3] + outs[6:])


@pytest.mark.parametrize(
    ("kind", "value", "needle"),
    [
        ("json_schema", '{"type": "objec"}', "objec"),
        ("regex", "[0-9", ""),
        ("ebnf", 'root ::= "a" missing', "missing"),
    ],
    ids=["schema", "regex", "ebnf"],
)
def test_an_invalid_constraint_fails_alone(
    engine: Engine, kind: str, value: str, needle: str
) -> None:
    jobs = [
        ("Hi", {**GREEDY, "max_new_tokens": 8, kind: value}),
        ("Hi", {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}),
        ("Hi", {**GREEDY, "max_new_tokens": 8, "regex": "[0-9]{2}"}),
    ]
    bad, free, good = run_all(engine, jobs)
    assert isinstance(bad, RequestFailed) and bad.status == 400, bad
    assert str(bad).startswith("invalid ") and needle in str(bad)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    assert re.fullmatch("[0-9]{2}", good.text)
    with pytest.raises(RequestFailed, match="give at most one of"):
        engine.generate("Hi", {"regex": "a", "ebnf": 'root ::= "a"'})
