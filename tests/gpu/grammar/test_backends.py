"""Both built-in grammar backends, the same tests: masks and acceptance agree with the
constraint (random walks over real token masks, checked with jsonschema and re),
rollback and copy, termination, structural tags, and clear errors for bad input."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from actorlm.gpu.grammar import BaseGrammarBackend, GrammarError

from .conftest import EOS, VOCAB, allowed, walk

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        },
        "required": ["ok"],
    },
]


def decode(backend: BaseGrammarBackend, ids: list[int]) -> str:
    return backend.ctx.tokenizer.decode(ids)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "optional"])
def test_random_walks_through_a_json_schema_validate(
    backend: BaseGrammarBackend, schema: dict[str, object]
) -> None:
    template = backend.dispatch("json_schema", json.dumps(schema))
    for seed in range(3):
        text = decode(backend, walk(template.copy(), seed))
        jsonschema.validate(json.loads(text), schema)


def test_compact_json_is_spaced_as_json_dumps(backend: BaseGrammarBackend) -> None:
    # both backends write what docs/api.md says: ", " and ": " between items, no more
    for seed in range(3):
        text = decode(backend, walk(backend.dispatch("json_schema", json.dumps(SCHEMAS[0])), seed))
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text


def test_regex_and_ebnf_walks_match(backend: BaseGrammarBackend) -> None:
    regex = r"(cat|dog)-[0-9]{2,3}"
    for seed in range(3):
        text = decode(backend, walk(backend.dispatch("regex", regex), seed))
        assert re.fullmatch(regex, text), text
    ebnf = 'root ::= "(" num ("+" num){0,2} ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        text = decode(backend, walk(backend.dispatch("ebnf", ebnf), seed))
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)", text), text
        assert eval(text) > 0  # noqa: S307 - the grammar allows only digits, + and ()


def _mask(grammar: object) -> torch.Tensor:
    out = torch.empty(1, (VOCAB + 31) // 32, dtype=torch.int32)
    grammar.fill_vocab_mask(out, 0)  # type: ignore[attr-defined]
    return out[0].clone()


def test_rollback_copy_and_termination(backend: BaseGrammarBackend) -> None:
    tok = backend.ctx.tokenizer
    grammar = backend.dispatch("regex", "abc[0-9]")
    start = _mask(grammar)
    ids = tok.encode("abc", add_special_tokens=False)  # type: ignore[attr-defined]
    for t in ids:
        assert grammar.accept_token(t)
    fork = grammar.copy()
    grammar.rollback(len(ids))
    assert torch.equal(_mask(grammar), start)
    # The copy kept its own state: only digits now, the original is back at the start.
    digits = allowed(_mask(fork))
    assert digits and all(tok.decode([t]).isdigit() for t in digits)  # type: ignore[attr-defined]
    probe = fork.copy()  # refusing may leave a matcher in an error state: use a copy
    assert not probe.accept_token(ids[0])
    seven = tok.encode("7", add_special_tokens=False)  # type: ignore[attr-defined]
    assert fork.accept_token(seven[0])
    assert allowed(_mask(fork)) == [EOS]


def test_batch_fill_and_accept_are_the_one_at_a_time_calls(backend: BaseGrammarBackend) -> None:
    """A step's matchers go through ``fill_vocab_masks``/``accept_tokens`` together: the
    same rows (into scattered rows of a bigger mask) and the same verdicts, a refused
    token included, as each matcher's own calls."""
    template = backend.dispatch("json_schema", json.dumps(SCHEMAS[0]))
    rng = random.Random(0)
    grammars = []
    for k in range(6):  # six states: the start, keys, numbers, strings
        g = template.copy()
        for _ in range(k * 2):
            g.accept_token(rng.choice([t for t in allowed(_mask(g)) if t != EOS]))
        grammars.append(g)
    alone = [g.copy() for g in grammars]
    rows = [7, 0, 3, 5, 1, 6]
    mask = torch.zeros(8, (VOCAB + 31) // 32, dtype=torch.int32)
    type(template).fill_vocab_masks(grammars, mask, rows)
    for g, row in zip(alone, rows, strict=True):
        assert torch.equal(mask[row], _mask(g))
    picks = [rng.choice(allowed(mask[row])) for row in rows]
    picks[2] = next(t for t in range(VOCAB) if t not in set(allowed(mask[rows[2]])))  # refused
    want = [g.accept_token(t) for g, t in zip(alone, picks, strict=True)]
    assert type(template).accept_tokens(grammars, picks) == want
    assert want.count(False) == 1
    for k in (0, 1, 3, 4, 5):  # the accepted ones moved on alike
        assert torch.equal(_mask(grammars[k]), _mask(alone[k]))


def test_json_strings_take_no_raw_control_characters(backend: BaseGrammarBackend) -> None:
    tok = backend.ctx.tokenizer
    for schema in ('{"type": "string", "maxLength": 5}', '{"type": "string"}'):
        grammar = backend.dispatch("json_schema", schema)
        assert grammar.accept_token(tok.encode('"', add_special_tokens=False)[0])  # type: ignore[attr-defined]
        texts = [tok.decode([t]) for t in allowed(_mask(grammar))]  # type: ignore[attr-defined]
        assert texts and not [t for t in texts if any(ord(c) < 0x20 for c in t)]


def test_a_finished_grammar_allows_only_the_stop_token(backend: BaseGrammarBackend) -> None:
    grammar = backend.dispatch("regex", "yes")
    for t in backend.ctx.tokenizer.encode("yes", add_special_tokens=False):  # type: ignore[attr-defined]
        assert grammar.accept_token(t)
    assert allowed(_mask(grammar)) == [EOS]
    assert grammar.accept_token(EOS)
    assert grammar.is_terminated()


def test_structural_tag_frees_text_until_a_trigger(backend: BaseGrammarBackend) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"enum": [1, 2]}, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    grammar = backend.dispatch("structural_tag", json.dumps(tag))
    tok = backend.ctx.tokenizer
    for t in tok.encode("Hello there <f>", add_special_tokens=False):  # type: ignore[attr-defined]
        assert grammar.accept_token(t)
    inside = {tok.decode([t]) for t in allowed(_mask(grammar))}  # type: ignore[attr-defined]
    assert inside and inside <= {"1", "2", " "}, inside


@pytest.mark.parametrize(
    ("kind", "value", "needle"),
    [
        ("json_schema", '{"type": "objec"}', "objec"),
        ("json_schema", '{"type": "object", "properties": ', ""),
        ("regex", "a(b", ""),
        ("ebnf", 'root ::= "a" undefined_rule', "undefined_rule"),
    ],
    ids=["unknown-type", "not-json", "unclosed-group", "undefined-rule"],
)
def test_invalid_constraints_raise_a_clear_error(
    backend: BaseGrammarBackend, kind: str, value: str, needle: str
) -> None:
    with pytest.raises(GrammarError) as info:
        backend.dispatch(kind, value)
    message = str(info.value)
    assert message and "\n" not in message and needle in message
