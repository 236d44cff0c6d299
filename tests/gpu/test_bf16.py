"""bfloat16 against transformers run in bfloat16 on the same weights (and both against
fp32 transformers), tiny random models and the default model.

Tolerances, relative to the largest logit of the reference (``scale``): bf16 keeps 8
bits of mantissa and transformers' own bf16 logits lie 2-8% of scale from its fp32 ones
on these models. Ours prefill through torch's bf16 GEMMs (as transformers does) and
decode with fp32 arithmetic over bf16 weights and KV (or the GGUF's exact blocks):

- prefill logits within 3% of scale of transformers bf16;
- decode logits, fed transformers' greedy tokens, within 5% of scale of its bf16 ones,
  and the same argmax at every step where its top two differ by more than 2% of scale;
- no farther from fp32 transformers than its bf16 model is: over the steps, on average
  within 1.25x, and the worst step within 2x of its worst. One step's worst logit is a
  noisy measure: six random tiny models through the model's layers on a 2-core Zen 4
  gave 0.73-1.64x transformers' worst step, with the averages 0.84-1.05x.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.gpu import onednn
from actorlm.gpu.forward_meta import SeqSpec

from .helpers import Pages, hf_cache_kwarg, make_runner
from .kernels.test_qgemm import _block_model

STEPS = 16


def hf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy_logits(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    from transformers import DynamicCache

    cache = {hf_cache_kwarg(model): DynamicCache()}
    ids, tokens, logits = torch.tensor([prompt]), [], []
    for _ in range(steps):
        row = model(input_ids=ids, use_cache=True, **cache).logits[0, -1].float()
        logits.append(row)
        tokens.append(int(row.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


def forced_logits(
    path: Path, quantization: str, prompt: list[int], tokens: list[int], fused: bool = True
) -> torch.Tensor:
    """Ours in bf16: the prompt, then ``tokens`` fed one decode step each (through the
    fused native step, or with ``fused=False`` the model's own layers)."""
    off = {} if fused else {"fused_decode_max_batch": 0}
    runner = make_runner(path, dtype="bfloat16", quantization=quantization, num_pages=64, **off)
    assert (runner.fused is not None) == fused
    if not fused and onednn.available(runner.device, runner.dtype):  # packed where it runs
        assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.model.layers.modules())
    pages = Pages()
    rows = [runner.run([SeqSpec(prompt, 0, pages.table("a", len(prompt)))])[0]]
    for i, tok in enumerate(tokens[:-1]):
        n = len(prompt) + i
        rows.append(runner.run([SeqSpec([tok], n, pages.table("a", n + 1))])[0])
    return torch.stack(rows)


def check(
    path: Path, quantization: str, prompt: list[int], fp32: Any = None, fused: bool = True
) -> None:
    fp32 = fp32 if fp32 is not None else hf(path, torch.float32)  # cast below for bf16
    tokens, want = hf_greedy_logits(copy.deepcopy(fp32).to(torch.bfloat16), prompt, STEPS)
    got = forced_logits(path, quantization, prompt, tokens, fused)
    scale = want.abs().max().item()
    diff = (got - want).abs().max(dim=-1).values
    assert diff[0] <= 0.03 * scale, ("prefill", diff[0].item(), scale)
    assert diff[1:].max() <= 0.05 * scale, ("decode", diff.tolist(), scale)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * scale
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    with torch.inference_mode():
        ref = fp32(input_ids=torch.tensor([prompt + tokens[:-1]])).logits
    ref = ref[0, len(prompt) - 1 :].float()
    ours, theirs = (got - ref).abs().max(-1).values, (want - ref).abs().max(-1).values
    assert ours.mean() <= 1.25 * theirs.mean(), (ours.tolist(), theirs.tolist())
    assert ours.max() <= 2 * theirs.max(), (ours.tolist(), theirs.tolist())


def distances_to_fp32(
    path: Path, prompt: list[int], steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's largest distance from fp32 transformers' logits, ours in bf16 (fed its
    bf16 greedy tokens, through the fused step) and transformers' own in bf16."""
    fp32 = hf(path, torch.float32)
    tokens, want = hf_greedy_logits(copy.deepcopy(fp32).to(torch.bfloat16), prompt, steps)
    got = forced_logits(path, "none", prompt, tokens)
    with torch.inference_mode():
        ref = fp32(input_ids=torch.tensor([prompt + tokens[:-1]])).logits
    ref = ref[0, len(prompt) - 1 :].float()
    return (got - ref).abs().max(-1).values, (want - ref).abs().max(-1).values


PROMPT = list(range(100, 141))


def test_tiny_model(tiny_llama: Path) -> None:
    check(tiny_llama, "none", PROMPT)


def test_tiny_model_over_a_long_context(tiny_llama: Path) -> None:
    """A 600-token context, decoded by the fused step over bf16 pages (on AMX tiles or
    bf16 dot products where the CPU has them). Over so long a context transformers' own
    bf16 logits lie 9-26% of scale from its fp32 ones on this random model, so ours are
    held to fp32 instead: at every step no farther from it than transformers' bf16 are,
    within 1.5x (they are 2-10x nearer)."""
    prompt = [(7 * j) % 1000 + 1 for j in range(600)]
    ours, theirs = distances_to_fp32(tiny_llama, prompt, 8)
    assert (ours <= 1.5 * theirs).all(), (ours.tolist(), theirs.tolist())


def test_tiny_model_through_its_layers(tiny_llama: Path) -> None:
    """Decode through the model's layers: their linears packed for oneDNN on CPUs with
    native bf16 (the fused step reads plain weights, so with it they stay plain)."""
    check(tiny_llama, "none", PROMPT, fused=False)


@pytest.mark.parametrize("fused", [True, False])
def test_tiny_qwen3(family_model_factory: Callable[..., Path], fused: bool) -> None:
    """Qwen3 (its q and k heads RMS-normed before RoPE) through the fused step, and
    through its layers with every linear packed."""
    check(family_model_factory("qwen3"), "none", PROMPT, fused=fused)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_tiny_gemma(family_model_factory: Callable[..., Path], name: str) -> None:
    """Gemma 2 and 3 through the fused step in bf16 (scaled embeddings, output norms,
    tanh-GELU, windows shorter than the prompt, soft caps; Gemma 3's two RoPE bases)."""
    check(family_model_factory(name), "none", PROMPT)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tiny_sparse_moe(family_model_factory: Callable[..., Path], name: str) -> None:
    """Qwen3-MoE and Mixtral in bf16 through the fused step, its router's inputs, scores
    and weights rounded as the model's forward rounds them: no farther from fp32
    transformers than the forward. (Neither is held to transformers' bf16 as above: a
    router's near-equal experts go one way or the other with any rounding, and the tiny
    Mixtral's experts give outputs ~12x their inputs (~50 against ~4), so a flip moves
    its logits far: transformers' bf16 and ours both flip in its second layer's prompt
    rows, and ours lie ~1.7x farther from fp32 on average over the steps.)"""
    path = family_model_factory(name)
    fp32 = hf(path, torch.float32)
    tokens, _ = hf_greedy_logits(copy.deepcopy(fp32).to(torch.bfloat16), PROMPT, STEPS)
    with torch.inference_mode():
        ref = fp32(input_ids=torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    dist = {}
    for fused in (True, False):
        runner = make_runner(
            path, dtype="bfloat16", num_pages=64, fused_decode_max_batch=-1 if fused else 0
        )
        assert (runner.fused is not None) == fused
        pages, rows = Pages(), []
        for i, ids in enumerate([PROMPT, *([t] for t in tokens[:-1])]):
            start = 0 if i == 0 else len(PROMPT) + i - 1
            seq = SeqSpec(ids, start, pages.table("a", start + len(ids)))
            rows.append(runner.run([seq])[0])
        dist[fused] = (torch.stack(rows) - ref.float()).abs().max(-1).values
    assert dist[True].mean() <= 1.1 * dist[False].mean(), (dist[True], dist[False])
    # the worst step within 2x, as above: on an Ice Lake (the avx512 build: fp32 rows
    # against bf16 weights) one Qwen3-MoE step's router went the other way, its worst
    # logit 1.48x the forward's worst with the averages 0.99x (2026-12-07)
    assert dist[True].max() <= 2 * dist[False].max(), (dist[True], dist[False])


def test_tiny_phi4_mini_shape(family_model_factory: Callable[..., Path]) -> None:
    """Phi-4-mini's shape (RoPE on 3/4 of each head, LongRoPE past 32 tokens) through
    the fused step. On this random model transformers' own bf16 logits lie ~4% of scale
    from its fp32 ones on average, and the step (fp32 activations) parts from them by up
    to ~6% while nearer fp32 than they are: held to fp32, as the long context is, at
    every step no farther from it than transformers' bf16 within 1.5x."""
    ours, theirs = distances_to_fp32(family_model_factory("phi3"), PROMPT, STEPS)
    assert (ours <= 1.5 * theirs).all(), (ours.tolist(), theirs.tolist())
    assert ours.mean() <= theirs.mean(), (ours.tolist(), theirs.tolist())


def test_tiny_block_model_decodes_its_exact_blocks(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    check(path, "gguf", PROMPT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model(
    default_gguf: Path, default_gguf_transformers: Any, tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt = tok("Write a short poem about the sea.\n")["input_ids"]
    check(default_gguf, "gguf", prompt, default_gguf_transformers)


def test_a_block_head_gives_fp32_logits(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A bf16 model's GGUF head computes fp32 logits in the forward, as the fused step's
    does: rounded to bf16 two tokens near 25 tie at 0.125 apart (the default model's
    first answer to a question hung on one such tie)."""
    from actorlm.gpu.kernels import qgemm
    from actorlm.gpu.quantization import GGUFLinear

    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    runner = make_runner(path, dtype="bfloat16", quantization="gguf", fused_decode_max_batch=0)
    head = runner.model.head
    assert isinstance(head, GGUFLinear)
    row = runner.run([SeqSpec(PROMPT, 0, Pages().table("a", len(PROMPT)))])[0]
    assert row.dtype == torch.float32
    assert not torch.equal(row, row.bfloat16().float())  # not bf16 values widened
    x = torch.randn(3, head.lin.k).bfloat16()
    w_t = qgemm.linear(torch.eye(head.lin.k), head.lin)  # W^T: the blocks' exact values
    assert w_t is not None
    want = x.double() @ w_t.double()
    torch.testing.assert_close(head.logits(x).double(), want, rtol=1e-5, atol=1e-4)
