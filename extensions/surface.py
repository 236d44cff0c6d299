"""The stable hook surface: the functions and methods meant to be hooked, and where
each runs.

``HookRegistry`` patches any dotted path, as the seeds' registry does; these are the
targets whose names and signatures hold still. A signature here changes only with
``API_VERSION`` (a test snapshots them in tests/extensions/hook_surface.json), and a
plugin that declares ``REQUIRES_API`` in its entry point's module is refused at start
when this engine's version is not among those it accepts. Hooking any other target
works, and is logged once as outside the surface.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from .registry import import_object

__all__ = ["API_VERSION", "HOOK_TARGETS", "HookTarget", "declared", "signature_of"]

API_VERSION = 1


@dataclass(frozen=True)
class HookTarget:
    target: str
    process: str  # where its code runs (hooks are applied in every process)
    summary: str


_T = HookTarget
HOOK_TARGETS: tuple[HookTarget, ...] = (
    _T("actorlm.launch.resolve_config", "every entry point", "the config, filled from the model"),
    _T("actorlm.gateway.params.openai_sampling", "gateway", "SamplingParams of an OpenAI request"),
    _T("actorlm.gateway.params.native_sampling", "gateway", "SamplingParams of /generate"),
    _T("actorlm.actors.tokenizer.tokenization.load_tokenizer", "tokenizer", "the tokenizer"),
    _T(
        "actorlm.actors.tokenizer.actor.TokenizerActor._check",
        "tokenizer",
        "checks a tokenized prompt; returns the sampling the scheduler gets",
    ),
    _T("actorlm.actors.scheduler.policy.BatchPlanner.add", "scheduler", "queues (or refuses)"),
    _T("actorlm.actors.scheduler.policy.BatchPlanner.build_batch", "scheduler", "plans a step"),
    _T(
        "actorlm.actors.scheduler.policy.BatchPlanner.on_result",
        "scheduler",
        "takes a step's tokens",
    ),
    _T("actorlm.actors.cache.kv_cache.KVCacheManager.admit", "cache_manager", "pages for a prompt"),
    _T(
        "actorlm.actors.cache.kv_cache.KVCacheManager.finish",
        "cache_manager",
        "a request's pages back",
    ),
    _T("actorlm.gpu.runner.ModelRunner.forward", "worker", "one ForwardBatch to its StepResult"),
    _T("actorlm.gpu.loaders.base.load_model", "worker", "the model and its weights"),
    _T("actorlm.gpu.sampling.Sampler", "worker", "the batched sampler (REPLACE with a subclass)"),
    _T("actorlm.gpu.sampling.Sampler.add", "worker", "a sequence's sampling state"),
    _T("actorlm.gpu.sampling.Sampler.sample", "worker", "next tokens for a step's logits"),
    _T("actorlm.gpu.logit_processors.build_processors", "worker", "a request's logit processors"),
    _T(
        "actorlm.gpu.platforms.CpuPlatform.default_attention_backend",
        "every process",
        "the CPU's attention backend",
    ),
)

_DECLARED = frozenset(t.target for t in HOOK_TARGETS)


def declared(target: str) -> bool:
    return target in _DECLARED


def signature_of(target: str) -> str:
    """The call signature of ``target`` (a class: its constructor's), as text."""
    module, _, attr = target.rpartition(".")
    parts = [attr]
    obj = None
    while module:  # the longest importable module prefix
        try:
            obj = import_object(f"{module}:{'.'.join(parts)}")
            break
        except (ImportError, AttributeError):
            module, _, attr = module.rpartition(".")
            parts.insert(0, attr)
    if obj is None:
        raise ImportError(f"cannot resolve hook target {target!r}")
    return str(inspect.signature(obj.__init__ if inspect.isclass(obj) else obj))
