"""The worker's grammar state: compiling constraints, and every running request's matcher.

Where compilation happens, and why: in the worker process, in a small thread pool
(``--grammar-compile-threads``), never on an event loop. The worker is where the
matchers must live (they fill the bitmask the sampler applies), so compiling there
moves no compiled grammar between processes; xgrammar and llguidance release the
GIL while they compile, so the worker's loop keeps answering and its forward pass
keeps running. The scheduler asks for a compile (``CompileGrammar``) when a
constrained request arrives and keeps that request out of its queue until the
reply: a request waiting for its grammar holds no batch slot and no KV page, and a
step never waits for a compile. (A separate grammar actor would cost a transfer of
every compiled grammar and buy nothing on one worker.)

- The cache holds one future per constraint (kind, text), LRU-bounded: requests
  with the same schema share one compile, and a repeated schema costs a dict
  look-up. Failures are cached too, so a bad schema sent again fails at once.
- A constraint the backend cannot compile goes to the fallback backend (see
  ``--grammar-fallback``); the one that compiled it is reported per request.
- The timeout (``--grammar-compile-timeout``) is the waiter's (the worker actor's):
  a compile past it fails its request, keeps running, and its result is cached.
- Backends are built on first use, in a compile thread: an engine that never sees a
  constraint never loads a grammar library.

Per step, ``fill_async`` fills the bitmask rows of the batch's constrained requests
on a thread of its own while the model's forward pass runs, one batch call per
backend; the sampler applies them; ``accept_all`` advances each matcher by its
sampled token, again one call per backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ...config import GrammarConfig
from ...extensions.points import GRAMMAR_BACKENDS
from ...messages.sampling import SamplingParams
from .base import BaseGrammarBackend, BaseGrammarObject, GrammarContext
from .reasoner import ReasonerGrammarObject, ThinkTokens

__all__ = ["Compiled", "GrammarManager", "GrammarSetup", "backend_order"]

log = logging.getLogger(__name__)

_LABELS = {
    "json_schema": "JSON schema",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}
# --grammar-fallback auto: the other built-in.
_OTHER = {"xgrammar": "llguidance", "llguidance": "xgrammar"}


@dataclass(frozen=True)
class GrammarSetup:
    """What the manager needs from the model, loaded on first use (in a compile thread)."""

    context: GrammarContext
    think: ThinkTokens | None = None  # with --reasoning-parser: where thinking ends


@dataclass(frozen=True)
class Compiled:
    """A compile's outcome: a fresh grammar object to copy per request, or why not."""

    backend: str
    grammar: BaseGrammarObject | None
    error: str = ""
    compile_ms: float = 0.0


def backend_order(cfg: GrammarConfig) -> list[str]:
    """The backends a constraint is tried with, in order."""
    primary, fallback = cfg.grammar_backend, cfg.grammar_fallback
    if primary == "none":
        return []
    if fallback == "auto":
        fallback = _OTHER.get(primary, "xgrammar")
    return [primary] + ([fallback] if fallback not in ("none", primary) else [])


class GrammarManager:
    def __init__(
        self,
        cfg: GrammarConfig,
        load: Callable[[], GrammarSetup],
        backends: dict[str, BaseGrammarBackend] | None = None,
    ) -> None:
        """``backends``: ones already built (by name), shared instead of built again."""
        self.cfg = cfg
        self._load = load
        self._setup: GrammarSetup | None = None
        self._setup_error = ""
        self._backends: dict[str, BaseGrammarBackend] = backends if backends is not None else {}
        self._build_lock = threading.RLock()  # backends and the setup are built once
        self._cache: OrderedDict[tuple[str, str], Future[Compiled]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._compiles = ThreadPoolExecutor(
            cfg.grammar_compile_threads, thread_name_prefix="grammar-compile"
        )
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._grammars: dict[str, BaseGrammarObject] = {}
        self._served_by: dict[str, str] = {}
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._stop: torch.Tensor | None = None
        self._prepared: Future[None] | None = None
        self.order = backend_order(cfg)

    # -- compiling ---------------------------------------------------------------
    def prepare(self) -> Future[None]:
        """Build the backends (the tokenizer's tables: about a second, once), so the
        compile timeout measures compiles only. Every caller shares one future."""
        with self._cache_lock:
            if self._prepared is None:
                self._prepared = self._compiles.submit(self._build_all)
            return self._prepared

    def _build_all(self) -> None:
        for name in self.order:
            try:
                self._backend(name)
            except Exception:  # reported by each compile that needs it
                log.exception("grammar backend %s failed to start", name)

    def compile(self, kind: str, value: str) -> Future[Compiled]:
        """The compile of ``(kind, value)``: started now, or shared with the one already
        started or done (a done future for a cached constraint)."""
        key = (kind, value)
        with self._cache_lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._compiles.submit(self._compile_now, kind, value)
            self._cache[key] = fut
            excess = len(self._cache) - self.cfg.grammar_cache_entries
            for old in [k for k, f in self._cache.items() if f.done()][: max(excess, 0)]:
                del self._cache[old]
            return fut

    def cached(self, kind: str, value: str) -> bool:
        fut = self._cache.get((kind, value))
        return fut is not None and fut.done()

    def _compile_now(self, kind: str, value: str) -> Compiled:
        t0 = time.perf_counter()
        label = _LABELS.get(kind, kind)
        if not self.order:
            return Compiled(
                "", None, "structured output is off on this server (--grammar-backend none)"
            )
        invalid: list[str] = []  # what the backends said about the constraint
        broken: list[str] = []  # backends that could not start (the server's problem)
        for name in self.order:
            try:
                backend = self._backend(name)
            except Exception as exc:
                broken.append(f"the {name} grammar backend cannot start: {exc}")
                continue
            try:
                grammar = backend.dispatch(kind, value)
            except Exception as exc:  # a bad constraint is the client's 400, never a crash
                invalid.append(str(exc) or type(exc).__name__)
                if name != self.order[-1]:
                    log.info("%s could not compile a %s (%s); trying the next", name, label, exc)
                continue
            return Compiled(name, grammar, compile_ms=(time.perf_counter() - t0) * 1e3)
        if invalid:
            return Compiled("", None, f"invalid {label}: {invalid[0]}")
        return Compiled("", None, broken[0])

    def _backend(self, name: str) -> BaseGrammarBackend:
        backend = self._backends.get(name)
        if backend is not None:
            return backend
        with self._build_lock:
            if name not in self._backends:
                setup = self.setup()
                self._backends[name] = GRAMMAR_BACKENDS.get(name)(setup.context)
                log.info("grammar backend %s ready", name)
            return self._backends[name]

    def setup(self) -> GrammarSetup:
        """The model's tokenizer and think tokens, loaded once (raises what loading did)."""
        if self._setup is not None:
            return self._setup
        with self._build_lock:
            if self._setup is None:
                if self._setup_error:
                    raise RuntimeError(self._setup_error)
                try:
                    self._setup = self._load()
                except Exception as exc:
                    self._setup_error = f"structured output is unavailable: {exc}"
                    raise RuntimeError(self._setup_error) from exc
            return self._setup

    # -- requests ------------------------------------------------------------------
    def __contains__(self, rid: object) -> bool:
        return rid in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def backend_of(self, rid: str) -> str:
        return self._served_by.get(rid, "")

    def start(
        self, rid: str, sampling: SamplingParams, token_ids: Sequence[int], prompt_len: int
    ) -> None:
        """Give ``rid`` its matcher, advanced past the outputs it already has (a retracted
        request comes back with them). ``ValueError`` says why it cannot run."""
        self.release(rid)
        constraint = sampling.constraint
        if constraint is None:
            return
        fut = self.compile(*constraint)
        if not fut.done():  # compiled before admission, normally; not after a restart
            log.warning("request %s waits for its grammar inside a step", rid)
        compiled = fut.result(timeout=self.cfg.grammar_compile_timeout_s)
        if compiled.grammar is None:
            raise ValueError(compiled.error)
        grammar = compiled.grammar.copy()
        think = self.setup().think
        if think is not None:
            grammar = ReasonerGrammarObject.for_prompt(grammar, think, token_ids[:prompt_len])
        for token in token_ids[prompt_len:]:
            if not grammar.accept_token(token):
                raise ValueError("the request's earlier output does not match its constraint")
        self._grammars[rid] = grammar
        self._served_by[rid] = compiled.backend

    def release(self, rid: str) -> None:
        self._grammars.pop(rid, None)
        self._served_by.pop(rid, None)

    def release_all(self) -> None:
        self._grammars.clear()
        self._served_by.clear()

    def fill_async(self, rids: Sequence[str]) -> Future[dict[int, torch.Tensor]]:
        """Start filling the mask rows of ``rids`` (all constrained) on the mask thread;
        the result maps each index into ``rids`` to its row (unconstrained ones left out)."""
        return self._masker.submit(self.fill, rids)

    def fill(self, rids: Sequence[str]) -> dict[int, torch.Tensor]:
        words = self.setup().context.bitmask_words
        if self._bitmask.shape[0] < len(rids) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(16, 2 * len(rids)), words, dtype=torch.int32)
        out: dict[int, torch.Tensor] = {}
        batches: dict[type[BaseGrammarObject], tuple[list[BaseGrammarObject], list[int]]] = {}
        for i, rid in enumerate(rids):
            grammar = self._grammars[rid]
            if grammar.is_terminated():  # its stop token was taken and ignored: only more
                self._bitmask[i] = self._stop_row(words)
            elif grammar.constrains_next:
                batch = batches.setdefault(type(grammar), ([], []))
                batch[0].append(grammar)
                batch[1].append(i)
            else:
                continue
            out[i] = self._bitmask[i]
        for cls, (grammars, rows) in batches.items():  # one call per backend
            cls.fill_vocab_masks(grammars, self._bitmask, rows)
        return out

    def _stop_row(self, words: int) -> torch.Tensor:
        """The mask of a finished grammar: its stop tokens only (built once)."""
        if self._stop is None or self._stop.shape[0] != words:
            bits = torch.zeros(words * 32, dtype=torch.bool)
            bits[list(self.setup().context.eos_token_ids)] = True
            packed = np.packbits(bits.numpy(), bitorder="little").view(np.int32)
            self._stop = torch.from_numpy(packed.copy())
        return self._stop

    def accept(self, rid: str, token: int) -> bool:
        """Advance ``rid``'s matcher; False (and its matcher dropped) if it refused."""
        return rid not in self.accept_all([(rid, token)])

    def accept_all(self, picks: Sequence[tuple[str, int]]) -> list[str]:
        """Advance each ``(rid, token)``'s matcher, one batch call per backend; returns the
        rids whose matcher refused its token, in ``picks`` order. A refusing matcher is
        dropped; a finished one is kept (it allows only its stop tokens, as before)."""
        eos = self.setup().context.eos_token_ids if self._grammars else ()
        refused: set[str] = set()
        batches: dict[type[BaseGrammarObject], tuple[list[BaseGrammarObject], list[int]]] = {}
        taking: dict[type[BaseGrammarObject], list[str]] = {}
        for rid, token in picks:
            grammar = self._grammars.get(rid)
            if grammar is None:
                continue
            if grammar.is_terminated():
                if token not in eos:
                    refused.add(rid)
                continue
            batch = batches.setdefault(type(grammar), ([], []))
            batch[0].append(grammar)
            batch[1].append(token)
            taking.setdefault(type(grammar), []).append(rid)
        for cls, (grammars, tokens) in batches.items():
            for rid, ok in zip(taking[cls], cls.accept_tokens(grammars, tokens), strict=True):
                if not ok:
                    self.release(rid)
                    refused.add(rid)
        return [rid for rid, _ in picks if rid in refused]

    def close(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)
        self._masker.shutdown(wait=False)
