"""Shared by the gpu tests: a runner over a tiny model, a toy page allocator standing in
for the cache manager, and greedy loops for actorlm and for transformers (reference)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from actorlm.config import ModelConfig
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.runner import ModelRunner
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=1 << 20)


def make_runner(path: Path | str, **overrides: Any) -> ModelRunner:
    """A runner in float32 unless told otherwise (``dtype="auto"`` picks bf16 on CPUs with
    native bf16, and these tests compare with fp32 transformers)."""
    opts: dict[str, Any] = {
        "path": str(path),
        "num_pages": 256,
        "page_size": 16,
        "dtype": "float32",
    }
    opts.update(overrides)
    return ModelRunner(ModelConfig(**opts))


class Pages:
    """Hands out page ids the way the cache manager would (never reused here)."""

    def __init__(self, page_size: int = 16, first: int = 0) -> None:
        self.page_size = page_size
        self.next = first
        self.tables: dict[str, list[int]] = {}

    def table(self, rid: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.page_size < num_tokens:
            table.append(self.next)
            self.next += 1
        return list(table)


class Seq:
    """A request as the scheduler tracks it: prompt, outputs, tokens already cached."""

    def __init__(self, rid: str, prompt: list[int], pages: Pages) -> None:
        self.rid, self.prompt, self.pages = rid, list(prompt), pages
        self.out: list[int] = []
        self.cached = 0
        self.started = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def step(self, chunk: int | None = None) -> SeqStep:
        """The next SeqStep: (the rest of / a chunk of) the prompt, or one decode token."""
        todo = self.tokens[self.cached :]
        ids = todo if chunk is None else todo[:chunk]
        init = (
            None
            if self.started
            else SeqInit(sampling=GREEDY, token_ids=self.prompt, prompt_len=len(self.prompt))
        )
        self.started = True
        end = self.cached + len(ids)
        sample = end == len(self.tokens)
        step = SeqStep(self.rid, ids, self.cached, self.pages.table(self.rid, end), sample, init)
        self.cached = end
        return step


def run_step(runner: ModelRunner, seqs: list[Seq], steps: list[SeqStep], step_id: int = 0) -> None:
    result = runner.forward(ForwardBatch(step_id=step_id, seqs=steps))
    by_rid = {s.rid: s for s in seqs}
    assert [r.rid for r in result.results] == [s.rid for s in steps if s.sample]
    for r in result.results:
        by_rid[r.rid].out.append(r.token_id)


def greedy(runner: ModelRunner, rid: str, prompt: list[int], steps: int, pages: Pages) -> list[int]:
    seq = Seq(rid, prompt, pages)
    for i in range(steps):
        run_step(runner, [seq], [seq.step()], i)
    runner.forward(ForwardBatch(step_id=steps, seqs=[], release=[rid]))
    return seq.out


def hf_model(path: Path | str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_cache_kwarg(model: Any) -> str:
    """The keyword transformers' forward takes its KV cache by: ``cache`` in recent
    releases, ``past_key_values`` before. A wrong one is swallowed by ``**kwargs`` and the
    model silently runs without its cache, so it is read off the (base) model's signature."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, never stopping at EOS."""
    from transformers import DynamicCache

    cache = {hf_cache_kwarg(model): DynamicCache()}
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=True, **cache).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.tensor([[tok]])
    return out


@torch.inference_mode()
def hf_last_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def assert_matches_hf(runner: ModelRunner, ref: Any, prompts: list[list[int]]) -> None:
    """Each prompt's last logits within 1e-4 of ``ref``'s (one batched prefill), and
    32 greedy tokens of the second prompt equal to ``ref``'s."""
    pages = Pages()
    ours = runner.run([SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        d = (ours[i] - hf_last_logits(ref, prompt)).abs().max().item()
        assert d < 1e-4, d
    assert greedy(runner, "g", prompts[1], 32, pages) == hf_greedy(ref, prompts[1], 32)


# Prompts that run past Gemma's windows (8, 16 tokens) and Phi-3's original context (32).
PROMPT_A = [(i * 7919) % 40000 + 100 for i in range(41)]
PROMPT_B = [(i * 104729) % 40000 + 100 for i in range(37)]
PROMPT_C = PROMPT_A[:32] + [5, 17, 923, 4, 4, 88, 1200, 31, 7]  # A's first two pages, then its own
PROMPT_D = [42, 4242, 424]


def assert_prefill_logits_match(runner: ModelRunner, ref: Any, tol: float = 1e-4) -> None:
    """Each prompt's last logits within ``tol`` of ``ref``'s, alone and in one ragged batch."""
    prompts = [PROMPT_A, PROMPT_D, PROMPT_B]
    want = [hf_last_logits(ref, p) for p in prompts]
    pages = Pages()
    batch = runner.run([SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        alone = runner.run([SeqSpec(prompt, 0, pages.table(f"s{i}", len(prompt)))])[0]
        assert (alone - want[i]).abs().max().item() < tol, f"prompt {i} alone"
        assert (batch[i] - want[i]).abs().max().item() < tol, f"prompt {i} in the batch"


def assert_greedy_matches_everywhere(runner: ModelRunner, ref: Any, steps: int = 32) -> None:
    """``steps`` greedy tokens equal to ``ref``'s: alone; then three requests decoding in
    one batch, one extending another's cached prefix, one whose prompt is prefilled in
    two chunks."""
    pages = Pages()
    assert greedy(runner, "a", PROMPT_A, steps, pages) == hf_greedy(ref, PROMPT_A, steps)
    b, c, d = Seq("b", PROMPT_B, pages), Seq("c", PROMPT_C, pages), Seq("d", PROMPT_D, pages)
    pages.tables["c"] = pages.tables["a"][:2]  # a's pages, as the radix cache hands them over
    c.cached = 32
    run_step(runner, [b, c, d], [b.step(chunk=20), c.step(), d.step()])  # b's first chunk
    step = 1
    while any(len(s.out) < steps for s in (b, c, d)):
        live = [s for s in (d, b, c) if len(s.out) < steps]
        run_step(runner, live, [s.step() for s in live], step)
        step += 1
    for seq in (b, c, d):
        assert seq.out == hf_greedy(ref, seq.prompt, steps), seq.rid
