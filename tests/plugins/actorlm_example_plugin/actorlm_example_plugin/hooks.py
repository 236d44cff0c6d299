"""Function hooks of all four kinds on engine functions.

* REPLACE the worker's ``Sampler`` class with a subclass (the runner builds it
  by name, so the replacement is what it gets);
* AROUND ``Sampler.sample``: it reaches the replacement class too, and counts
  the rows sampled (one per generated token);
* BEFORE ``BatchPlanner.add`` in the scheduler: counts admitted requests;
* AFTER the tokenizer's request check: counts checked requests.
"""

from __future__ import annotations

from typing import Any

from actorlm.actors.scheduler.policy import BatchPlanner
from actorlm.actors.tokenizer import TokenizerActor
from actorlm.extensions.hooks import HookRegistry, HookType, plugin_hook
from actorlm.gpu.sampling import Sampler
from actorlm.messages.generate import GenerateRequest, TokenizedRequest
from actorlm.messages.sampling import SamplingParams

from .record import record

__all__ = ["ExampleSampler", "after_check", "before_add", "count_sampled_rows"]


@plugin_hook("actorlm.gpu.sampling.Sampler", type=HookType.REPLACE)
class ExampleSampler(Sampler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        record("sampler.init")


@plugin_hook("actorlm.gpu.sampling.Sampler.sample", type=HookType.AROUND)
def count_sampled_rows(original: Any, self: Sampler, rids: list[str], *args: Any) -> Any:
    results = original(self, rids, *args)
    record("sampler.sample", len(rids))
    return results


def before_add(self: BatchPlanner, msg: TokenizedRequest, reply_to: str) -> None:
    record("planner.add")
    return None  # keep the arguments as they are


def after_check(
    result: SamplingParams, self: TokenizerActor, req: GenerateRequest, ids: list[int]
) -> None:
    record("tokenizer.check")
    return None  # keep the result


HookRegistry.register(
    "actorlm.actors.scheduler.policy.BatchPlanner.add", before_add, HookType.BEFORE
)
HookRegistry.register(
    "actorlm.actors.tokenizer.actor.TokenizerActor._check", after_check, HookType.AFTER
)
