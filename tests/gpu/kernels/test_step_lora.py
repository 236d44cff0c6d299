"""The fused decode step with LoRA adapters (cpu_step.c over the worker's slots) against
the model's forward with the same adapters (the torch path, itself checked against
``peft`` in tests/gpu/lora): decode steps mixing base rows and adapters of different
ranks and targets, fp32 and bf16; which adapter steps it takes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.kernels.lora import native_lora
from actorlm.gpu.kernels.step import native_step
from actorlm.gpu.lora.batch import BASE
from actorlm.gpu.lora.plan import LoraPlan
from actorlm.gpu.runner import ModelRunner

from ...conftest import LORA_ADAPTERS
from ...models import build_lora_adapter
from ..helpers import Pages, make_runner
from ..lora.test_lora_layers import PROMPTS, lora_runner
from .test_step import both_ways

pytestmark = pytest.mark.skipif(
    native_step() is None or native_lora() is None, reason="needs a C compiler"
)

NAMES = ["chat", "", "sql", "sparse", "all", "", "chat"]  # "": the base model


def decode(runner: ModelRunner, steps: int, *, adapters: bool = True) -> list[torch.Tensor]:
    """Prefill every prompt of NAMES (rows grouped by slot, as the worker groups them),
    then ``steps`` greedy decode steps (without ``adapters``: of the base model alone);
    each decode step's logits, in NAMES order."""
    pool = runner.lora
    assert pool is not None
    slots = [BASE if not n else pool.slot_of(n) for n in NAMES]
    order = sorted(range(len(NAMES)), key=lambda i: slots[i])
    grouped = [slots[i] for i in order]
    pages = Pages()
    prompts = [PROMPTS[NAMES[i]] for i in order]
    pos = [len(p) for p in prompts]
    seqs = [SeqSpec(p, 0, pages.table(f"s{j}", len(p))) for j, p in enumerate(prompts)]
    inverse = torch.tensor(sorted(range(len(order)), key=lambda j: order[j]))
    seen = []
    for step in range(steps + 1):
        lens = [len(s.input_ids) for s in seqs]
        use = adapters or not step
        pool.plan = LoraPlan.build(lens, grouped, pool.ranks, native=True) if use else None
        try:
            logits = runner.run(seqs)
        finally:
            pool.plan = None
        if step:
            seen.append(logits[inverse])
        nxt = logits.argmax(1).tolist()
        seqs = [SeqSpec([t], pos[j], pages.table(f"s{j}", pos[j] + 1)) for j, t in enumerate(nxt)]
        pos = [p + 1 for p in pos]
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_adapter_steps_match_the_models_forward(
    tiny_llama: Path, lora_adapters: dict[str, Path], dtype: str
) -> None:
    fused = lora_runner(tiny_llama, lora_adapters, quantization="none", dtype=dtype)
    plain = lora_runner(
        tiny_llama, lora_adapters, quantization="none", dtype=dtype, fused_decode_max_batch=0
    )
    assert fused.fused is not None and fused.fused.step.has_lora and plain.fused is None
    # bf16: the model rounds every activation to bf16, the fused step keeps fp32, so
    # their greedy paths part after a few steps, base rows alike (~0.4 on logits of ~5
    # here, with or without adapters): one step from the same inputs, and that bound.
    # The deltas' bf16 arithmetic is checked tightly in test_lora.py.
    steps, tol = (4, 1e-4) if dtype == "float32" else (1, 0.6)
    got, want = decode(fused, steps), decode(plain, steps)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < tol
    # the step does add the deltas: each adapted row differs from the base model's by far
    # more than that, on the same input; base rows are the same bits
    base = decode(fused, 1, adapters=False)[0]
    diff = (got[0] - base).abs().amax(1)
    assert all((d > 2) == bool(n) for d, n in zip(diff.tolist(), NAMES, strict=True))


def test_an_adapted_decode_over_a_long_context(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    """A lone decode with an adapter on every projection over 1,200 tokens: its q, k and
    v deltas are in before its context attends in parts of its keys (cpu_step.c), as
    the model's forward attends it, and the parts give what one whole context gives."""
    prompt = [(7 * j) % 900 + 1 for j in range(1200)]
    out = []
    for opts in ({}, {"fused_decode_max_batch": 0}):
        runner = lora_runner(tiny_llama, lora_adapters, quantization="none", **opts)
        pool = runner.lora
        assert pool is not None
        slot, pages = pool.slot_of("all"), Pages()
        pool.plan = LoraPlan.build([len(prompt)], [slot], pool.ranks, native=True)
        runner.run([SeqSpec(prompt, 0, pages.table("s", len(prompt)))])
        pool.plan = LoraPlan.build([1], [slot], pool.ranks, native=True)
        step = [SeqSpec([5], len(prompt), pages.table("s", len(prompt) + 1))]
        if runner.fused is None:
            out.append(runner.run(step))
        else:  # the parts, and one whole context from the same pool
            whole, parts = both_ways(runner, step, "split_keys")
            out.append(parts)
            assert (parts - whole).abs().max().item() < 1e-4
        pool.plan = None
    assert (out[0] - out[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_adapted_projections_are_normed_after_their_deltas(
    family_model_factory: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
    family: str,
) -> None:
    """Qwen3 adds q's and k's deltas to the projections, then norms each head; Gemma 3
    adds o's and down's deltas, then norms those outputs before the residual takes them:
    the fused step in that order too (fp32, against the model's forward)."""
    base = family_model_factory(family)
    root = tmp_path_factory.mktemp(f"{family}-lora")
    adapters = {
        name: build_lora_adapter(base, root / name, **spec)  # type: ignore[arg-type]
        for name, spec in LORA_ADAPTERS.items()
    }
    fused = lora_runner(base, adapters, quantization="none", dtype="float32")
    plain = lora_runner(
        base, adapters, quantization="none", dtype="float32", fused_decode_max_batch=0
    )
    assert fused.fused is not None and fused.fused.step.has_lora and plain.fused is None
    for g, w in zip(decode(fused, 3), decode(plain, 3), strict=True):
        assert (g - w).abs().max().item() < 1e-4


def test_adapter_steps_it_takes(tiny_llama: Path, lora_adapters: dict[str, Path]) -> None:
    runner = lora_runner(tiny_llama, lora_adapters, quantization="none")
    fused = runner.fused
    assert fused is not None and runner.lora is not None
    one = [SeqSpec([5], 3, [0]), SeqSpec([6], 3, [1])]
    ranks = runner.lora.ranks
    assert fused.accepts(one, LoraPlan.build([1, 1], [BASE, 0], ranks, native=True))
    # a plan for the torch path (no rows) is the model's to run
    assert not fused.accepts(one, LoraPlan.build([1, 1], [BASE, 0], ranks))
    bare = make_runner(tiny_llama, quantization="none")  # a step without set_lora
    assert bare.fused is not None and not bare.fused.step.has_lora
    assert not bare.fused.accepts(one, LoraPlan.build([1, 1], [BASE, 0], ranks, native=True))


def many_rows(runner: ModelRunner, n: int, threads: int = 0) -> torch.Tensor:
    """Prompts of 3 tokens for n sequences (NAMES' adapters in turn, rows grouped by
    slot), then one decode step of n rows (the fused step's on ``threads`` threads):
    its logits."""
    pool, fused = runner.lora, runner.fused
    assert pool is not None
    if threads:
        assert fused is not None
        fused.threads.options = lambda: [threads]  # type: ignore[method-assign]
    slots = sorted(BASE if not (a := NAMES[i % len(NAMES)]) else pool.slot_of(a) for i in range(n))
    pages = Pages()
    prompts = [[(7 * j) % 500 + 3, j % 11 + 600, 42] for j in range(n)]
    seqs = [SeqSpec(p, 0, pages.table(f"s{j}", 3)) for j, p in enumerate(prompts)]
    try:
        pool.plan = LoraPlan.build([3] * n, slots, pool.ranks, native=True)
        nxt = runner.run(seqs).argmax(1).tolist()
        step = [SeqSpec([t], 3, pages.table(f"s{j}", 4)) for j, t in enumerate(nxt)]
        pool.plan = LoraPlan.build([1] * n, slots, pool.ranks, native=True)
        assert fused is None or fused.accepts(step, pool.plan)
        return runner.run(step)
    finally:
        pool.plan = None


def test_a_step_of_many_rows_shares_the_residual_rows(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    """From cpu_step.c's CLAIM_MIN_ROWS rows (AMX builds) the threads claim the linears'
    columns and share the residual rows, each adding its adapters' deltas, normalizing
    and rounding its part of them: 240 rows with adapters give the model's forward's
    logits (fp32), and the same bits on one thread as on two (fp32 and bf16)."""
    n = 240
    plain = lora_runner(tiny_llama, lora_adapters, quantization="none", fused_decode_max_batch=0)
    for dtype in ("float32", "bfloat16"):
        runner = lora_runner(
            tiny_llama, lora_adapters, quantization="none", dtype=dtype, fused_decode_max_batch=n
        )
        two = many_rows(runner, n, 2)
        assert torch.equal(two, many_rows(runner, n, 1))
        if dtype == "float32":
            assert (two - many_rows(plain, n)).abs().max().item() < 1e-4
