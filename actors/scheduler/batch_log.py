"""The scheduler's batch lines, as SGLang's scheduler logs them: one for each step that
computed prompt tokens, and one every ``decode_log_interval`` decode-only steps with the
generation throughput since the last; both with the load (running and queued requests,
the KV tokens the running requests hold, against the pool) and the worker's time a step.
An operator sees load and speed in the log without a metrics stack.

    Prefill batch. #new-seq: 1, #new-token: 359, #cached-token: 0, token usage: 0.05,
        #running-req: 8, #queue-req: 0, step: 80.1 ms
    Decode batch. #running-req: 8, #token: 2437, token usage: 0.13, gen throughput
        (token/s): 812.40, #queue-req: 0, step: 9.5 ms
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from ...messages.step import ForwardBatch, SeqStep, StepResult

__all__ = ["BatchLog", "is_prompt"]

log = logging.getLogger(__name__)


def is_prompt(seq: SeqStep) -> bool:
    """A chunk of a prompt (its first carries the request's init), not a decode."""
    return seq.init is not None or len(seq.input_ids) > 1


class BatchLog:
    """Counts steps as their results come back and logs them; ``interval`` 0 logs none."""

    def __init__(
        self, interval: int, capacity_tokens: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.capacity = max(capacity_tokens, 1)
        self.clock = clock
        self._since: float | None = None  # the window's start: its first step's
        self._decode_steps = 0  # decode-only steps since the last decode line
        self._sampled = 0  # tokens sampled since then, prompts' first tokens included
        self._forward_ms = 0.0

    def step(
        self,
        batch: ForwardBatch,
        result: StepResult,
        kv_tokens: Iterable[int],
        running: int,
        queued: int,
    ) -> None:
        """One step's result. ``kv_tokens``: the tokens each running request holds in the
        KV cache; ``running``/``queued``: the requests running and waiting now."""
        if self.interval <= 0:
            return
        if self._since is None:  # from when its first step was sent, not from start-up
            self._since = self.clock() - result.forward_ms / 1e3
        self._sampled += len(result.results)
        prompts = [s for s in batch.seqs if is_prompt(s)]
        if prompts:
            held = sum(kv_tokens)
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d, step: %.1f ms",
                sum(s.init is not None for s in prompts),
                sum(len(s.input_ids) for s in prompts),
                sum(s.start_pos for s in prompts if s.init is not None),
                held / self.capacity,
                running,
                queued,
                result.forward_ms,
            )
            return
        self._decode_steps += 1
        self._forward_ms += result.forward_ms
        if self._decode_steps < self.interval:
            return
        now = self.clock()
        held = sum(kv_tokens)
        log.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
            "gen throughput (token/s): %.2f, #queue-req: %d, step: %.1f ms",
            running,
            held,
            held / self.capacity,
            self._sampled / max(now - self._since, 1e-6),
            queued,
            self._forward_ms / self._decode_steps,
        )
        self._since, self._decode_steps, self._sampled, self._forward_ms = None, 0, 0, 0.0
