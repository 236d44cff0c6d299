"""The worker's grammar manager: one compile per constraint (cached, failures too),
concurrent compiles off the caller's thread, fallback between backends, a backend
chosen by name from the registry (a plugin's), and per-request matchers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import jsonschema
import pytest
import torch
from actorlm.config import GrammarConfig
from actorlm.extensions.points import GRAMMAR_BACKENDS
from actorlm.gpu.grammar import BaseGrammarBackend, BaseGrammarObject, GrammarContext
from actorlm.gpu.grammar.manager import GrammarManager, GrammarSetup, backend_order
from actorlm.gpu.grammar.xgrammar_backend import XGrammarGrammarBackend
from actorlm.messages.sampling import SamplingParams

from .conftest import EOS, allowed, walk

# xgrammar's own structural-tag form, which llguidance does not read: a fallback case.
XGRAMMAR_TAG = json.dumps(
    {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
)


@pytest.fixture(scope="module")
def shared() -> dict[str, BaseGrammarBackend]:
    """Backends built once for every manager here (each costs about a second)."""
    return {}


@pytest.fixture
def manager(
    context: GrammarContext, shared: dict[str, BaseGrammarBackend]
) -> Iterator[Callable[..., GrammarManager]]:
    made: list[GrammarManager] = []

    def make(**cfg: object) -> GrammarManager:
        m = GrammarManager(GrammarConfig(**cfg), lambda: GrammarSetup(context), shared)  # type: ignore[arg-type]
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture
def xgr(manager: Callable[..., GrammarManager]) -> GrammarManager:
    return manager()


def test_backend_order_follows_the_flags() -> None:
    assert backend_order(GrammarConfig()) == ["xgrammar", "llguidance"]
    assert backend_order(GrammarConfig(grammar_backend="llguidance")) == ["llguidance", "xgrammar"]
    assert backend_order(GrammarConfig(grammar_fallback="none")) == ["xgrammar"]
    assert backend_order(GrammarConfig(grammar_backend="none")) == []


def test_a_constraint_compiles_once_and_then_costs_a_lookup(xgr: GrammarManager) -> None:
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    first = xgr.compile("json_schema", schema)
    assert xgr.compile("json_schema", schema) is first  # a second asker shares the compile
    assert first.result(timeout=60).backend == "xgrammar"
    t0 = time.perf_counter()
    again = xgr.compile("json_schema", schema)
    assert again.done() and again is first and time.perf_counter() - t0 < 0.01
    bad = xgr.compile("regex", "(").result(timeout=60)
    assert bad.grammar is None and bad.error.startswith("invalid regex:")
    assert xgr.compile("regex", "(").result().error == bad.error  # failures are cached too


def test_compiles_run_concurrently_off_the_callers_thread(
    manager: Callable[..., GrammarManager],
) -> None:
    m = manager(grammar_compile_threads=2)
    m.prepare().result(timeout=60)
    names: set[str] = set()
    real = m._compile_now

    def spy(kind: str, value: str) -> object:
        names.add(threading.current_thread().name)
        return real(kind, value)

    m._compile_now = spy  # type: ignore[method-assign]
    futures = [m.compile("regex", f"[a-z]{{1,{n}}}x") for n in range(20, 26)]
    assert all(f.result(timeout=60).grammar is not None for f in futures)
    assert threading.current_thread().name not in names
    assert all(n.startswith("grammar-compile") for n in names)


def test_the_cache_is_bounded(manager: Callable[..., GrammarManager]) -> None:
    m = manager(grammar_cache_entries=2)
    for r in ("a", "b", "c"):
        m.compile("regex", r).result(timeout=60)
    m.compile("regex", "d")
    assert not m.cached("regex", "a") and len(m._cache) <= 3


def test_fallback_to_the_other_backend_and_none(manager: Callable[..., GrammarManager]) -> None:
    llg = manager(grammar_backend="llguidance")
    assert llg.compile("structural_tag", XGRAMMAR_TAG).result(timeout=60).backend == "xgrammar"
    alone = manager(grammar_backend="llguidance", grammar_fallback="none")
    out = alone.compile("structural_tag", XGRAMMAR_TAG).result(timeout=60)
    assert out.grammar is None and "llguidance reads structural tags only as" in out.error
    off = manager(grammar_backend="none")
    assert "--grammar-backend none" in off.compile("regex", "a").result(timeout=60).error


def test_a_schema_xgrammar_would_ignore_goes_to_the_fallback_or_is_refused(
    manager: Callable[..., GrammarManager], context: GrammarContext
) -> None:
    """xgrammar compiles these and ignores the keyword: the fallback gets them."""
    auto = manager()
    # Two numeric ranges at once: llguidance enforces allOf.
    both = {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]}
    out = auto.compile("json_schema", json.dumps(both)).result(timeout=60)
    assert out.backend == "llguidance" and out.grammar is not None
    for seed in range(3):
        text = context.tokenizer.decode(walk(out.grammar.copy(), seed))
        jsonschema.validate(json.loads(text), both)
    # llguidance refuses uniqueItems too: a 400 naming the keyword and where it is.
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    out = auto.compile("json_schema", json.dumps(unique)).result(timeout=60)
    assert out.grammar is None and out.error == (
        'invalid JSON schema: xgrammar does not enforce "uniqueItems" (at #/properties/tags)'
    )
    full = {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 2}}}
    assert auto.compile("json_schema", json.dumps(full)).result(timeout=60).backend == "xgrammar"
    alone = manager(grammar_fallback="none")
    out = alone.compile("json_schema", json.dumps(both)).result(timeout=60)
    assert out.grammar is None and '"allOf" of more than one schema (at #)' in out.error


class CountingBackend(XGrammarGrammarBackend):
    """A plugin's backend: xgrammar, counting its compiles."""

    name = "test_counting"
    compiles = 0

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        CountingBackend.compiles += 1
        return super().dispatch_regex(regex)


def test_a_registered_backend_is_selected_by_name(context: GrammarContext) -> None:
    GRAMMAR_BACKENDS.register("test_counting", CountingBackend, source="test")
    m = GrammarManager(
        GrammarConfig(grammar_backend="test_counting"), lambda: GrammarSetup(context)
    )
    try:
        assert m.compile("regex", "[0-9]+").result(timeout=60).backend == "test_counting"
        assert CountingBackend.compiles == 1
    finally:
        m.close()
        GRAMMAR_BACKENDS.unregister("test_counting")


def test_requests_get_their_own_matchers(xgr: GrammarManager, hf_tokenizer: object) -> None:
    sp = SamplingParams(regex="[0-9]{2}")
    seven = hf_tokenizer.encode("7", add_special_tokens=False)  # type: ignore[attr-defined]
    xgr.start("a", sp, [5, 6], prompt_len=2)
    xgr.start("b", sp, [5, 6, *seven], prompt_len=2)  # re-admitted after one output token
    rows = xgr.fill(["a", "b"])
    assert set(rows) == {0, 1} and EOS not in allowed(rows[0]) and EOS not in allowed(rows[1])
    assert xgr.accept("b", seven[0])
    assert allowed(xgr.fill(["b"])[0]) == [EOS]
    assert not xgr.accept("a", EOS)  # not allowed yet: its matcher is dropped
    assert "a" not in xgr and xgr.backend_of("b") == "xgrammar"
    with pytest.raises(ValueError, match="does not match its constraint"):
        xgr.start("c", sp, [5, 6, EOS], prompt_len=2)
    with pytest.raises(ValueError, match="invalid regex"):
        xgr.start("d", SamplingParams(regex="("), [5], prompt_len=1)


def test_a_steps_masks_and_tokens_go_per_backend(
    manager: Callable[..., GrammarManager], hf_tokenizer: object
) -> None:
    """One step's matchers of two backends (llguidance, and xgrammar for the tag it
    cannot read) and a finished one: each row is that matcher's own mask, and the
    verdicts come back per request, in order."""
    m = manager(grammar_backend="llguidance")
    enc = hf_tokenizer.encode  # type: ignore[attr-defined]
    m.start("tag", SamplingParams(structural_tag=XGRAMMAR_TAG), [5], prompt_len=1)
    m.start("num", SamplingParams(regex="[0-9]{2}"), [5], prompt_len=1)
    m.start("done", SamplingParams(regex="7"), [5, *enc("7", add_special_tokens=False)], 1)
    assert {m.backend_of(r) for r in ("tag", "num")} == {"xgrammar", "llguidance"}
    rows = m.fill(["num", "tag", "done"])
    assert allowed(rows[2]) == [EOS]
    own = [m._grammars[r].copy() for r in ("num", "tag")]
    for k, grammar in enumerate(own):
        mask = rows[k].clone().unsqueeze(0)
        grammar.fill_vocab_mask(mask, 0)
        assert torch.equal(mask[0], rows[k])
    hi = enc("hi", add_special_tokens=False)[0]
    three = enc("3", add_special_tokens=False)[0]
    assert m.accept_all([("tag", hi), ("free", 9), ("num", hi), ("done", EOS)]) == ["num"]
    assert "num" not in m and "tag" in m and m.accept_all([("num", three), ("done", 9)]) == ["done"]
