"""The real grammar backends over SmolLM2's tokenizer, built once per session (~1 s each)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from actorlm.extensions.points import GRAMMAR_BACKENDS
from actorlm.gpu.grammar import BaseGrammarBackend, BaseGrammarObject, GrammarContext

BACKENDS = ("xgrammar", "llguidance")
EOS = 2
VOCAB = 49152


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def context(hf_tokenizer: object) -> GrammarContext:
    return GrammarContext(tokenizer=hf_tokenizer, vocab_size=VOCAB, eos_token_ids=(EOS,))


@pytest.fixture(scope="session")
def make_backend(context: GrammarContext) -> Callable[[str], BaseGrammarBackend]:
    built: dict[str, BaseGrammarBackend] = {}

    def make(name: str) -> BaseGrammarBackend:
        if name not in built:
            built[name] = GRAMMAR_BACKENDS.get(name)(context)
        return built[name]

    return make


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, make_backend: Callable[[str], BaseGrammarBackend]
) -> BaseGrammarBackend:
    return make_backend(request.param)


def allowed(mask: torch.Tensor) -> list[int]:
    """Token ids a packed bitmask row allows."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:VOCAB])]


def walk(grammar: BaseGrammarObject, seed: int, max_steps: int = 400) -> list[int]:
    """Tokens of a random path through ``grammar`` (uniform over what its mask allows,
    ending as soon as a stop token is allowed half of the time), stop token excluded."""
    rng = random.Random(seed)
    mask = torch.empty(1, (VOCAB + 31) // 32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(max_steps):
        grammar.fill_vocab_mask(mask, 0)
        ids = allowed(mask[0])
        assert ids, "a live grammar allows some token"
        words = [t for t in ids if t != EOS]
        if not words or (EOS in ids and rng.random() < 0.5):
            assert EOS in ids
            assert grammar.accept_token(EOS)
            return out
        token = rng.choice(words)
        assert grammar.accept_token(token), token
        out.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")
