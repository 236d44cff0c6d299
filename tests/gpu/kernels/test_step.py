"""The fused decode step (kernels/step.py over cpu_step.c, gpu/fused_decode.py) against
the model's own forward on the same weights and steps: every linear method, every ISA
build, GQA and qkv bias, ragged batches over shuffled pages; which steps it takes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from actorlm.gpu.attention.torch_native import TorchNativeBackend
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.fused_decode import FusedDecoder, ThreadChooser
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels import step as step_module
from actorlm.gpu.kernels.step import native_step
from actorlm.gpu.quantization import fbgemm_available
from actorlm.gpu.runner import ModelRunner

from ..helpers import hf_model, make_runner
from .levels import LEVELS
from .test_qgemm import _block_model

pytestmark = pytest.mark.skipif(native_step() is None, reason="needs a C compiler")

TOL = 1e-4  # fp32 both ways, different summation orders; logits are O(10)


def decode_steps(
    runner: ModelRunner, prompts: list[list[int]], steps: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill ``prompts`` (one batch), then ``steps`` greedy decode steps of all of them;
    pages handed out shuffled, so tables are not runs. Returns each step's logits."""
    ids = list(range(runner.pool.num_pages))
    random.Random(seed).shuffle(ids)
    take = iter(ids)
    tables: dict[int, list[int]] = {}

    def table(i: int, n: int) -> list[int]:
        t = tables.setdefault(i, [])
        while len(t) * runner.pool.page_size < n:
            t.append(next(take))
        return list(t)

    logits = runner.run([SeqSpec(p, 0, table(i, len(p))) for i, p in enumerate(prompts)])
    out = [[int(x.argmax())] for x in logits]
    pos = [len(p) for p in prompts]
    seen = []
    for _ in range(steps):
        seqs = [SeqSpec([o[-1]], pos[i], table(i, pos[i] + 1)) for i, o in enumerate(out)]
        logits = runner.run(seqs)
        seen.append(logits)
        for i, row in enumerate(logits):
            out[i].append(int(row.argmax()))
            pos[i] += 1
    return seen, out


PROMPTS = [list(range(100, 141)), [5, 17, 923, 4, 4, 88, 1200, 31, 7], [42], list(range(7, 40))]
# the default batch bound: ragged lengths, several rows tiles of the C kernels (8 rows each)
WIDE = [[(7 * i + 3 * j) % 1000 + 1 for j in range(1 + (i * 13) % 70)] for i in range(32)]


def assert_fused_matches_model(
    path: Path,
    level: str = "",
    prompts: list[list[int]] = PROMPTS,
    steps: int = 6,
    tol: float = TOL,
    **opts: object,
) -> ModelRunner:
    fused = make_runner(path, **opts)
    if level:
        fused.fused, why = FusedDecoder.build(fused.model, fused.backend, 8, level)
        assert fused.fused is not None, why
    plain = make_runner(path, fused_decode_max_batch=0, **opts)
    assert fused.fused is not None and plain.fused is None
    assert fused.fused.accepts([SeqSpec([1], len(p), [0]) for p in prompts])
    got, got_tokens = decode_steps(fused, prompts, steps)
    want, want_tokens = decode_steps(plain, prompts, steps)
    assert got_tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < tol
    return fused


@pytest.mark.parametrize("level", LEVELS)
def test_every_isa_build_matches_the_model(tiny_llama: Path, level: str) -> None:
    assert_fused_matches_model(tiny_llama, level)


@pytest.fixture(scope="module")
def qwen2_bias(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Tiny Qwen2, one KV head for four query heads, non-zero q/k/v biases."""
    src = tiny_model_factory("qwen2", num_key_value_heads=1)
    model = hf_model(src)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("tiny-qwen2-bias")
    model.save_pretrained(str(out))
    for f in src.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_a_batch_of_32(tiny_llama: Path) -> None:
    assert_fused_matches_model(tiny_llama, prompts=WIDE, steps=3)


# contexts of hundreds of keys, beside a short one
LONG = [list(range(1, 1201)), [(5 * j) % 900 + 1 for j in range(600)], list(range(3, 515)), [9]]


def test_long_contexts(tiny_llama: Path) -> None:
    """Contexts of 1,200, 600 and 514 tokens beside a short one, and the longest alone,
    as the model's own forward attends them."""
    assert_fused_matches_model(tiny_llama, prompts=LONG, steps=3)
    assert_fused_matches_model(tiny_llama, prompts=LONG[:1], steps=2)


# contexts a decode step splits into parts of their keys (step_attention.h: in steps of
# fewer than 6 (sequence, KV head) tasks, about 6 tasks in all, 512 keys or more a part)
SPLIT = [[(11 * j) % 997 + 1 for j in range(4200)], [(3 * j) % 800 + 2 for j in range(1700)]]
SPLIT_TABLES = [list(range(265)), list(range(270, 380))]
SPLIT_STEPS = [  # a decode of the first alone, then one of both
    [SeqSpec([7], 4200, SPLIT_TABLES[0])],
    [SeqSpec([8], 4201, SPLIT_TABLES[0]), SeqSpec([9], 1700, SPLIT_TABLES[1])],
]


def both_ways(runner: ModelRunner, step: list[SeqSpec], switch: str) -> list[torch.Tensor]:
    """``step``'s logits with the fused step's ``switch`` off, then on, from one pool."""
    fused = runner.fused
    assert fused is not None and fused.accepts(step)
    before = runner.pool.kv.clone()
    out = []
    for on in (False, True):
        runner.pool.kv.copy_(before)
        setattr(fused.step, switch, on)
        out.append(runner.run(step))
    return out


def split_prefill(runner: ModelRunner) -> None:
    runner.run([SeqSpec(p, 0, t) for p, t in zip(SPLIT, SPLIT_TABLES, strict=True)])


def split_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """SPLIT prefilled, then SPLIT_STEPS: each step's logits."""
    split_prefill(runner)
    return [runner.run(step) for step in SPLIT_STEPS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_contexts_of_few_tasks_attend_in_parts(
    tiny_model_factory: Callable[..., Path], dtype: str
) -> None:
    """A decode step of few (sequence, KV head) tasks splits each long context's keys into
    parts that any thread takes, then merges each task's parts: a context of 4,200 tokens
    alone (2 KV heads: 3 parts each) and beside one of 1,700 (2 parts each) give what
    whole contexts give (only the sums' order differs: fp32 within TOL, bf16 within its
    output's rounding; fp32 also as the model's own forward attends them), with the
    same bits on 1 and 3 threads."""
    wide = {"hidden_size": 256} if dtype == "bfloat16" else {}  # 4 heads of 64
    path = tiny_model_factory("llama", max_position_embeddings=4400, **wide)
    opts: dict[str, object] = {"dtype": dtype, "num_pages": 400}
    runner = make_runner(path, **opts)
    split_prefill(runner)
    for i, step in enumerate(SPLIT_STEPS):
        whole, parts = both_ways(runner, step, "split_keys")
        tol = TOL if dtype == "float32" else 0.01 * whole.abs().max().item()
        assert (parts - whole).abs().max().item() < tol, i
        assert not torch.equal(parts, whole), i  # the parts did run: their sums' order
    if dtype == "float32":
        plain = make_runner(path, fused_decode_max_batch=0, **opts)
        for got, want in zip(
            split_steps(make_runner(path, **opts)), split_steps(plain), strict=True
        ):
            assert (got - want).abs().max().item() < TOL
    before_threads = torch.get_num_threads()
    try:
        out = [split_steps(make_runner(path, num_threads=n, **opts)) for n in (1, 3)]
    finally:
        torch.set_num_threads(before_threads)
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


@pytest.mark.parametrize("level", LEVELS)
def test_every_isa_build_attends_a_long_context_in_parts(
    tiny_model_factory: Callable[..., Path], level: str
) -> None:
    """Each ISA build's parts (attend.h's loops, or its bf16 paths' where a build has
    them) of a lone 4,200-token context, as the model's forward attends it."""
    path = tiny_model_factory("llama", max_position_embeddings=4400)
    assert_fused_matches_model(path, level, prompts=SPLIT[:1], steps=2, num_pages=400)


def fused_and_plain(path: Path, seed: int) -> tuple[ModelRunner, ModelRunner, list[list[int]]]:
    """A runner with the fused step and one without, and three tables of 8 pages."""
    fused = make_runner(path)
    plain = make_runner(path, fused_decode_max_batch=0)
    assert fused.fused is not None and plain.fused is None
    pages = list(range(fused.pool.num_pages))
    random.Random(seed).shuffle(pages)
    return fused, plain, [pages[:8], pages[8:16], pages[16:24]]


def assert_steps_match(
    fused: ModelRunner, plain: ModelRunner, steps: list[list[SeqSpec]], taken: list[bool]
) -> None:
    """Each step through both runners (the fused step takes those `taken`): the same
    logits, one row a sampling sequence."""
    assert fused.fused is not None
    for i, step in enumerate(steps):
        assert fused.fused.accepts(step) == taken[i], i
        got, want = fused.run(step), plain.run(step)
        assert got.shape == want.shape == (sum(s.sample for s in step), fused.info.vocab_size), i
        assert torch.allclose(got, want, rtol=0, atol=TOL), i


def test_short_prompts_and_extensions_of_a_cached_prefix(tiny_llama: Path) -> None:
    """Steps whose rows are a few new tokens of one sequence (a short prompt, the
    tokens over a cached prefix, across a page's end) beside decodes of others: each
    row attends to the keys up to its own, the sequence's last row gives its logits, as
    the model's forward gives them."""
    fused, plain, (a, b, c) = fused_and_plain(tiny_llama, 5)
    steps = [
        [SeqSpec(LONG[1][:40], 0, a), SeqSpec(PROMPTS[1], 0, b)],  # prompts: the forward
        [SeqSpec(LONG[1][40:46], 40, a), SeqSpec([7], 9, b), SeqSpec([3, 4, 5], 0, c)],
        [SeqSpec(LONG[1][46:60], 46, a, prompt_len=60), SeqSpec([8], 10, b)],  # page 3 to 4
        [SeqSpec([11], 60, a), SeqSpec([12], 11, b), SeqSpec([13, 14], 3, c)],
    ]
    assert_steps_match(fused, plain, steps, [False, True, True, True])


def test_a_prompts_chunks_before_its_last_ride_in_the_step(tiny_llama: Path) -> None:
    """A chunk of a prompt that samples nothing (not its last) runs in the fused step,
    beside decodes or alone: the step gives the sampling sequences' logits alone, and
    the chunk's K and V reach the pool as the model's forward writes them (the later
    chunks' and decodes' logits agree)."""
    fused, plain, (a, b, c) = fused_and_plain(tiny_llama, 9)
    steps = [
        [SeqSpec(PROMPTS[1], 0, b)],
        [SeqSpec(LONG[1][:12], 0, a, sample=False, prompt_len=24), SeqSpec([7], 9, b)],
        [SeqSpec(LONG[0][:10], 0, c, sample=False, prompt_len=20)],  # nothing sampled
        [
            SeqSpec(LONG[1][12:24], 12, a, prompt_len=24),
            SeqSpec(LONG[0][10:20], 10, c, prompt_len=20),
        ],
        [SeqSpec([11], 24, a), SeqSpec([8], 10, b), SeqSpec([12], 20, c)],
    ]
    assert_steps_match(fused, plain, steps, [True] * len(steps))


def together_against_rowwise(runner: ModelRunner, steps: list[list[SeqSpec]]) -> list[bool]:
    """Each step run with a sequence's rows attending together and a row at a time (from
    the same pool), within 3% of the scale; whether each step's two logits differ."""
    differs = []
    for i, step in enumerate(steps):
        rowwise, together = both_ways(runner, step, "extend_flash")
        scale = rowwise.abs().max().item()
        assert (together - rowwise).abs().max().item() <= 0.03 * scale, i
        differs.append(not torch.equal(together, rowwise))
    return differs


@pytest.mark.parametrize("weights", ["dense", "blocks"])
def test_extensions_attend_together_over_a_bf16_pool(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, weights: str
) -> None:
    """Over a bf16 pool, in the builds with AVX512-BF16, a sequence's 8 or more new
    tokens attend together as prompts do (flash.h: on AMX tiles where granted, else dot
    products), beside decodes, and give what they give a row at a time within bf16
    rounding (q, the probabilities and the output round to bf16; a step of 5 or more
    rows rounds the o projection's input to bf16 too). On the dot products a sequence
    takes up to 32 new tokens a step over dense layers, 64 over Q4_1 layers."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
    opts: dict[str, str] = {}
    if weights == "blocks":
        path, opts = _block_model(path, tmp_path / "blocks"), {"quantization": "gguf"}
    runner = make_runner(path, dtype="bfloat16", **opts)
    fused = runner.fused
    assert fused is not None
    level = fused.isa or native.best_isa().name
    if level not in ("avx512bf16", "amx"):
        pytest.skip(f"no bf16 products in the {level} build: it attends in fp32 (the test below)")
    tiles = fused.max_new == FusedDecoder.MAX_NEW
    dots = FusedDecoder.MAX_NEW_DOTS_Q4 if weights == "blocks" else FusedDecoder.MAX_NEW_DOTS
    assert tiles or fused.max_new == dots
    pages = list(range(runner.pool.num_pages))
    random.Random(7).shuffle(pages)
    a, b, c = pages[:60], pages[60:80], pages[80:82]
    runner.run([SeqSpec(LONG[1], 0, a), SeqSpec(PROMPTS[0], 0, b)])  # prompts: the forward
    steps = [
        [SeqSpec(LONG[0][100:112], 0, c)],  # a fresh prompt: each row's own key weighs much
        [SeqSpec(LONG[0][:20], 600, a), SeqSpec([7], 41, b)],  # 20 rows and a decode
        [SeqSpec(LONG[0][20:29], 620, a), SeqSpec([8], 42, b)],  # 9, across a page's end
        [SeqSpec(LONG[0][29:61], 629, a)],  # 32 rows
        [SeqSpec(LONG[0][61:66], 661, a), SeqSpec(LONG[0][70:79], 43, b)],  # 5 and 9
    ]
    if weights == "blocks":
        steps.append([SeqSpec(LONG[0][66:130], 666, a)])  # 64 rows
    differs = together_against_rowwise(runner, steps)  # seen: <= 1.7% of the scale
    # the rows did attend together: on AMX a row's own attention rounds q and P to bf16
    # as the tiles do, and a step's logits may then agree to the bit (seen: steps 3, 4)
    assert any(differs) if tiles else all(differs), differs


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_extensions_attend_together_in_fp32(
    tiny_model_factory: Callable[..., Path],
    family_model_factory: Callable[..., Path],
    name: str,
    level: str,
) -> None:
    """Over an fp32 pool (and a bf16 one, widened as read, where no bf16 products run), a
    sequence's 8 or more new tokens attend together in fp32 (flash_f32.h: rows along the
    vector lanes), beside decodes and across a page's end, in each ISA build, within
    Gemma 2's windows and with its capped scores too: what they give a row at a time
    within fp32 rounding, and not its bits (they did run together)."""
    path = (
        tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
        if name == "llama"
        else family_model_factory("gemma2", hidden_size=256, num_attention_heads=4)
    )
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(path, dtype=dtype)
        runner.fused, why = FusedDecoder.build(runner.model, runner.backend, 32, level)
        assert runner.fused is not None, why
        if dtype == "bfloat16" and level in ("avx512bf16", "amx"):
            continue  # bf16 products there (test_extensions_attend_together_over_a_bf16_pool)
        assert runner.fused.max_new >= 32
        pages = list(range(runner.pool.num_pages))
        random.Random(8).shuffle(pages)
        a, b, c = pages[:60], pages[60:80], pages[80:82]
        runner.run([SeqSpec(LONG[1], 0, a), SeqSpec(PROMPTS[0], 0, b)])
        steps = [
            [SeqSpec(LONG[0][100:112], 0, c)],  # a fresh prompt
            [SeqSpec(LONG[0][:20], 600, a), SeqSpec([7], 41, b)],  # 20 rows and a decode
            [SeqSpec(LONG[0][20:29], 620, a), SeqSpec([8], 42, b)],  # 9, across a page's end
            [SeqSpec(LONG[0][29:61], 629, a)],  # 32 rows: a part a thread
            [SeqSpec(LONG[0][61:66], 661, a), SeqSpec(LONG[0][70:79], 43, b)],  # 5 and 9
        ]
        for i, step in enumerate(steps):
            rowwise, together = both_ways(runner, step, "extend_flash")
            scale = rowwise.abs().max().item()
            assert (together - rowwise).abs().max().item() <= 1e-4 * scale, (dtype, i)
            assert not torch.equal(together, rowwise), (dtype, i)


def test_mha(tiny_model_factory: Callable[..., Path]) -> None:
    assert_fused_matches_model(tiny_model_factory("llama", num_key_value_heads=4))


def test_gqa_with_qkv_bias(qwen2_bias: Path) -> None:
    assert_fused_matches_model(qwen2_bias)


@pytest.mark.parametrize("level", LEVELS)
def test_qwen3s_q_and_k_norms(family_model_factory: Callable[..., Path], level: str) -> None:
    """Qwen3 norms each q and k head (random weights, D = 32) before RoPE: the step too,
    in every ISA build, its q norm told from its k norm."""
    runner = assert_fused_matches_model(family_model_factory("qwen3"), level)
    layer = runner.fused.step.weights.layers[0]  # type: ignore[union-attr]
    assert layer.q_norm is not None and layer.k_norm is not None
    assert not torch.equal(layer.q_norm, layer.k_norm)
    weights = runner.fused.step.weights  # type: ignore[union-attr]
    q, k = layer.q_norm, layer.k_norm
    for bad in ((q, None), (None, k), (q, k[:-1])):
        layer.q_norm, layer.k_norm = bad
        assert weights.check() == "q and k norms"
    layer.q_norm, layer.k_norm = q, k
    assert weights.check() == ""


@pytest.mark.parametrize("level", LEVELS)
def test_phi4_minis_partial_rotary(family_model_factory: Callable[..., Path], level: str) -> None:
    """Phi-4-mini's RoPE turns 3/4 of each head (the tiny Phi-3 of that shape, with its
    LongRoPE: prompts past 32 tokens take the long table, the others the short)."""
    runner = assert_fused_matches_model(family_model_factory("phi3"), level)
    weights = runner.fused.step.weights  # type: ignore[union-attr]
    assert 0 < weights.rotary_dim < weights.head_dim


@pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm (x86 PyTorch)")
@pytest.mark.parametrize("method", ["fp16", "gguf"])
def test_every_linear_method(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, method: str
) -> None:
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    runner = assert_fused_matches_model(path, quantization=method)
    kinds = {lin.kind for lin in (runner.fused.step.weights.head,)}  # type: ignore[union-attr]
    assert kinds == ({4} if method == "gguf" else {2})  # Q8_0 blocks; fp16 rows


def test_which_steps_it_takes(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama, fused_decode_max_batch=2)
    fused = runner.fused
    assert fused is not None
    one = SeqSpec([5], 3, [0])
    assert fused.accepts([one]) and fused.accepts([one, one])
    assert not fused.accepts([one, one, one])  # beyond max_batch
    assert fused.accepts([SeqSpec([5, 6], 3, [0])])  # an extend of two rows
    assert not fused.accepts([one, SeqSpec([5, 6], 0, [0])])  # three rows
    assert not fused.accepts([SeqSpec([5, 6, 7], 0, [0])])  # a prompt of three
    wide = make_runner(tiny_llama).fused  # fp32 pages and dense fp32 weights
    assert wide is not None and wide.max_new == FusedDecoder.MAX_NEW_FP32
    assert wide.accepts([SeqSpec([5] * wide.max_new, 0, [0])])
    assert not wide.accepts([SeqSpec([5] * (wide.max_new + 1), 0, [0])])
    assert fused.accepts([SeqSpec([5], 3, [0], sample=False)])  # a prompt's chunk
    assert not fused.accepts([])
    assert make_runner(tiny_llama, fused_decode_max_batch=0).fused is None
    assert wide.max_batch == FusedDecoder.MAX_BATCH  # the default (-1) off tiles


def test_a_bf16_model_on_tiles_takes_longer_steps_by_default(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Where a bf16 model's step runs on AMX tiles, the default takes steps of up to 640
    rows and a sequence's 512 new tokens (the linears' tiles sum over whole weights
    rounded to bf16 from 41 rows), and a 200-token extension beside a decode lands no
    farther from the fp32 model's logits than the bf16 forward does (this random model
    amplifies bf16's rounding: both land up to ~10% of the scale away); its rows attend in a
    part per thread, and one thread gives the same bits."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
    path = _block_model(path, tmp_path / "blocks")  # Q4_1 layers: the AMX block paths
    opts = {"quantization": "gguf"}
    runner = make_runner(path, dtype="bfloat16", **opts)
    fused = runner.fused
    assert fused is not None
    if fused.max_new != FusedDecoder.MAX_NEW:
        q4 = fused.max_new == FusedDecoder.MAX_NEW_DOTS_Q4  # Q4_1 layers on the dot products
        assert fused.max_batch == (FusedDecoder.MAX_BATCH_DOTS_Q4 if q4 else FusedDecoder.MAX_BATCH)
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    assert fused.max_batch == FusedDecoder.MAX_BATCH_TILES == 640 and fused.max_new == 512
    plain = make_runner(path, dtype="bfloat16", fused_decode_max_batch=0, **opts)
    exact = make_runner(path, dtype="float32", fused_decode_max_batch=0, **opts)
    alone = make_runner(path, dtype="bfloat16", **opts)
    fused.threads.options = lambda: [2]  # type: ignore[method-assign]
    alone.fused.threads.options = lambda: [1]  # type: ignore[union-attr,method-assign]
    a, b = list(range(0, 30)), list(range(30, 50))
    for r in (runner, plain, exact, alone):  # the prompts (each runner its own way)
        r.run([SeqSpec(LONG[1][:200], 0, a), SeqSpec(PROMPTS[0], 0, b)])
    step = [SeqSpec(LONG[1][200:400], 200, a), SeqSpec([7], len(PROMPTS[0]), b)]  # 201 rows
    assert fused.accepts(step) and fused.accepts([SeqSpec(LONG[1][:512], 0, a)])
    assert not fused.accepts([SeqSpec(LONG[1][:513], 0, a)])
    got, forward, want = runner.run(step), plain.run(step), exact.run(step)
    assert torch.equal(got, alone.run(step))
    err, bound = (got - want).abs().max().item(), (forward - want).abs().max().item()
    assert err <= 1.5 * bound, (err, bound)  # seen: 4.1 / 9.3
    assert bound <= 0.2 * want.abs().max().item()
    # 300 rows: the threads claim the linears' columns a chunk at a time (cpu_step.c's
    # CLAIM_MIN_ROWS), and a fresh prompt's parts are split by the keys they attend
    fresh = [SeqSpec(LONG[1][300:600], 0, list(range(50, 70)))]
    assert torch.equal(runner.run(fresh), alone.run(fresh))


def test_steps_past_one_call_run_as_several_in_order(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """On tiles a step of more rows than one call takes (a prefill budget past 512 tokens
    a sequence or 640 rows) runs as several calls: each sequence's tokens in chunks of
    512, each chunk in a later call than the one before, the rest where they fit; the
    sampled rows come back in the step's order, as the model's forward gives them."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
    path = _block_model(path, tmp_path / "blocks")
    opts = {"quantization": "gguf", "dtype": "bfloat16"}
    runner = make_runner(path, **opts)
    fused = runner.fused
    assert fused is not None
    a, b, c, d = list(range(8)), list(range(8, 80)), list(range(80, 100)), list(range(100, 108))
    runner.run([SeqSpec(PROMPTS[0], 0, a), SeqSpec(PROMPTS[3], 0, d)])
    step = [
        SeqSpec([7], len(PROMPTS[0]), a),  # a decode
        SeqSpec(LONG[0][:1100], 0, b, prompt_len=1100),  # a prompt in three chunks
        SeqSpec(LONG[1][:300], 0, c, sample=False, prompt_len=600),  # a chunk of a prompt
        SeqSpec([8], len(PROMPTS[3]), d),  # a decode
    ]
    # the calls, whatever this CPU's build: as a decoder on tiles would cut them
    tiles = fused.splits
    limits = fused.max_new, fused.max_batch
    fused.max_new, fused.max_batch = FusedDecoder.MAX_NEW, FusedDecoder.MAX_BATCH_TILES
    calls = fused.split(step)
    assert calls is not None
    shape = [[(i, s.start_pos, len(s.input_ids), s.sample) for i, s in call] for call in calls]
    assert shape == [
        [(0, 41, 1, True), (1, 0, 512, False), (3, 33, 1, True)],
        [(1, 512, 512, False)],
        [(1, 1024, 76, True), (2, 0, 300, False)],
    ]
    assert all(s.prompt_len == step[i].prompt_len for call in calls for i, s in call)
    assert fused.split(step[:1]) is None  # one call takes it
    fused.max_new, fused.max_batch = limits
    if not tiles:
        assert fused.split(step) is None  # prompts a few rows at a time: the forward's
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    assert make_runner(path, fused_decode_max_batch=64, **opts).fused.split(step) is None  # type: ignore[union-attr]
    plain = make_runner(path, fused_decode_max_batch=0, **opts)
    exact = make_runner(path, dtype="float32", fused_decode_max_batch=0, quantization="gguf")
    by_calls = make_runner(path, **opts)
    for r in (plain, exact, by_calls):
        r.run([SeqSpec(PROMPTS[0], 0, a), SeqSpec(PROMPTS[3], 0, d)])
    offered: list[tuple[torch.Tensor, torch.Tensor]] = []
    got = fused.run_split(calls, lambda logits, picks: offered.append((logits, picks)))
    forward, want = plain.run(step), exact.run(step)
    assert got.shape == want.shape == (3, want.shape[1])
    err, bound = (got - want).abs().max().item(), (forward - want).abs().max().item()
    assert err <= 1.5 * bound and bound <= 0.2 * want.abs().max().item(), (err, bound)
    assert len(offered) == 1 and offered[0][0] is got
    assert torch.equal(offered[0][1], got.argmax(-1))
    # the same calls one by one, each a step of its own: the same bits, reordered
    rows = [by_calls.run([s for _, s in call]) for call in calls]
    assert torch.equal(got, torch.cat([rows[0][0:1], rows[2][0:1], rows[0][1:2]]))
    assert by_calls.fused is not None and by_calls.fused.accepts([s for _, s in calls[0]])


@pytest.mark.parametrize("weights", ["dense", "blocks"])
def test_steps_on_the_weights_as_tiles_give_the_expanded_weights_bits(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    weights: str,
) -> None:
    """On AMX a bf16 model's step keeps its layers' weights as tiles written once
    (``FusedDecoder.AMX_TILES``): steps of 41 rows and more load them as they lie, gate
    and up meet in the tiles' SiLU epilogue, and the o projection reads the attention's
    own bf16 rows, and give the logits of a step that expands the weights every call,
    to the bit: the same products summed in the same order."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
    opts = {"quantization": "none"}
    if weights == "blocks":
        path, opts = _block_model(path, tmp_path / "blocks"), {"quantization": "gguf"}
    tiled = make_runner(path, dtype="bfloat16", **opts)
    if tiled.fused is None or not tiled.fused.step.tiles:
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    monkeypatch.setattr(FusedDecoder, "AMX_TILES", False)
    expanded = make_runner(path, dtype="bfloat16", **opts)
    assert expanded.fused is not None and not expanded.fused.step.tiles
    layers = len(tiled.fused.step.weights.layers)
    assert len(tiled.fused.step.tiles) == 4 * layers  # qkv, o, gate_up, down; not the head
    for r in (tiled, expanded):
        r.fused.threads.options = lambda: [2]  # type: ignore[union-attr,method-assign]
    a, b = list(range(0, 30)), list(range(30, 50))
    steps = [
        [SeqSpec(LONG[1][:300], 0, a), SeqSpec(PROMPTS[0], 0, b)],  # 341 rows: claims
        [SeqSpec(LONG[1][300:348], 300, a), SeqSpec([7], len(PROMPTS[0]), b)],  # 49 rows
        [SeqSpec(LONG[1][348:349], 348, a), SeqSpec([8], len(PROMPTS[0]) + 1, b)],  # decodes
    ]
    for i, step in enumerate(steps):
        assert tiled.fused.accepts(step)
        assert torch.equal(tiled.run(step), expanded.run(step)), i


def test_steps_read_the_tiles_where_the_cache_likely_holds_them(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 41 to 128 rows read the layers' tiles only after a step that read them,
    or from the third such step in a row: alone, after decodes of a few rows, they expand
    the codes (``FusedDecoder.COLD_TILES_FROM``), and every step gives the bits of a
    step that never reads tiles."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # D = 64
    path = _block_model(path, tmp_path / "blocks")
    tiled = make_runner(path, dtype="bfloat16", quantization="gguf")
    if tiled.fused is None or not tiled.fused.step.tiles:
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    monkeypatch.setattr(FusedDecoder, "AMX_TILES", False)
    expanded = make_runner(path, dtype="bfloat16", quantization="gguf")
    assert expanded.fused is not None and not expanded.fused.step.tiles
    a, b, ids = list(range(0, 30)), list(range(30, 50)), LONG[1]

    def chunk(lo: int, hi: int) -> list[SeqSpec]:
        return [SeqSpec(ids[lo:hi], lo, a)]

    steps = [
        chunk(0, 48),  # a prompt of 48 rows: the codes
        chunk(48, 49),  # a decode
        chunk(49, 97),  # 48 new tokens after it: the codes
        chunk(97, 145),
        chunk(145, 193),  # the third of 41 or more rows in a row: the tiles
        chunk(193, 241),  # after a step that read them: the tiles
        chunk(241, 242),
        [SeqSpec(LONG[0][:200], 0, b)],  # 129 rows or more: the tiles, always
        chunk(242, 290),  # after it: the tiles
    ]
    starts = []
    for i, step in enumerate(steps):
        assert tiled.fused.accepts(step)
        assert torch.equal(tiled.run(step), expanded.run(step)), i
        starts.append(tiled.fused.step.tiles_from)
    cold = FusedDecoder.COLD_TILES_FROM
    assert starts == [cold, cold, cold, cold, 41, 41, 41, cold, 41], starts
    for t in tiled.fused.step.tiles:  # now a step that reads the tiles shows it
        t.zero_()
    after = [chunk(290, 291), chunk(291, 339), chunk(339, 387), chunk(387, 435)]
    got, want = [tiled.run(s) for s in after], [expanded.run(s) for s in after]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the codes
    assert not torch.equal(got[3], want[3])  # the third in a row: the tiles


def test_tiles_that_would_take_half_the_memory_left_are_left_out(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)
    runner = make_runner(path, dtype="bfloat16", quantization="none")
    if runner.fused is None or not runner.fused.step.tiles:
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    need = sum(t.nbytes for t in runner.fused.step.tiles)
    monkeypatch.setattr(step_module, "_memory_available", lambda: 2 * need - 1)
    short = make_runner(path, dtype="bfloat16", quantization="none")
    assert short.fused is not None and not short.fused.step.tiles
    monkeypatch.setattr(step_module, "_memory_available", lambda: 2 * need)
    assert make_runner(path, dtype="bfloat16", quantization="none").fused.step.tiles  # type: ignore[union-attr]


def test_models_it_cannot_describe_keep_their_forward(tiny_llama: Path) -> None:
    runner = make_runner(tiny_llama)
    decoder, why = FusedDecoder.build(object(), runner.backend, 8)
    assert decoder is None and "registers no fused step" in why


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
@pytest.mark.parametrize("level", LEVELS)
def test_gemmas_layers(family_model_factory: Callable[..., Path], name: str, level: str) -> None:
    """Gemma 2 and 3 in every ISA build: embeddings scaled, the attention's and the MLP's
    outputs normed, tanh-GELU, sliding windows (16 and 8 keys, shorter than the
    contexts), Gemma 3's windowed layers on their own RoPE base and its q and k norms,
    Gemma 2's capped scores and logits. (Each of these dropped from the step's weights
    fails the comparison: tried.)"""
    runner = assert_fused_matches_model(family_model_factory(name), level)
    w = runner.fused.step.weights  # type: ignore[union-attr]
    assert w.act == "gelu_tanh" and w.embed_scale > 1 and w.windowed
    assert all(layer.attn_out_norm is not None for layer in w.layers)
    assert {layer.window for layer in w.layers} == ({0, 16} if name == "gemma2" else {0, 8})
    if name == "gemma2":
        assert w.softcap > 0 and w.final_softcap > 0 and w.ropes == 1
    else:
        assert w.ropes == 2 and {layer.rope for layer in w.layers} == {0, 1}
        assert all(layer.q_norm is not None for layer in w.layers)
    assert not runner.fused.cascade  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("level", LEVELS)
def test_sparse_moe_layers(
    family_model_factory: Callable[..., Path], name: str, level: str
) -> None:
    """Qwen3-MoE and Mixtral (top 2 of 8 experts, renormalized; random routers) in every
    ISA build, their prompts through the step too: the routing and the experts' rows
    gathered and weighted back as the model's forward does."""
    path = family_model_factory(name)
    runner = assert_fused_matches_model(path, level)
    layers = runner.fused.step.weights.layers  # type: ignore[union-attr]
    assert all(x.moe is not None and x.gate_up is None for x in layers)
    assert {(len(x.moe.experts), x.moe.top_k, x.moe.renormalize) for x in layers if x.moe} == {
        (8, 2, True)
    }
    moe = layers[0].moe
    assert moe is not None
    moe.top_k = 9
    assert runner.fused.step.weights.check() == "router or top k"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("quantization", ["none", "q4_1", "q4_1_a8"])
def test_sparse_moe_batches(
    family_model_factory: Callable[..., Path], name: str, quantization: str
) -> None:
    """32 sequences a step: most experts get several rows, some none; the experts' weights
    as the linear method leaves them (Q4_1 blocks too, on int8 rows with ``_a8``). Rows
    whose k-th and next expert lie ~1e-5 apart in probability (32 rows, 8 experts) carry
    the summation order's differences further than dense layers do: up to ~3e-4 of
    logits of ~13 (measured). On int8 rows the prompts run in the step too (at any size
    there), and a row whose fp32 sums differ from the forward's in their last bits may
    take an int8 code one off: up to ~0.11 (measured), within 2% of those logits."""
    tol = 0.25 if quantization.endswith("_a8") else 5 * TOL
    runner = assert_fused_matches_model(
        family_model_factory(name), prompts=WIDE, steps=3, tol=tol, quantization=quantization
    )
    experts = runner.fused.step.weights.layers[0].moe.experts  # type: ignore[union-attr]
    lins = [lin for pair in experts for lin in pair]
    assert {lin.kind for lin in lins} == ({0} if quantization == "none" else {3})
    assert {bool(lin.act_int8) for lin in lins} == {quantization.endswith("_a8")}  # int8 rows


def test_sparse_moe_results_do_not_depend_on_the_thread_count(
    family_model_factory: Callable[..., Path],
) -> None:
    """Each thread groups the pairs itself, alike, and each expert's output columns are
    one thread's: 1 or 3 threads give the same bits."""
    path, before = family_model_factory("qwen3_moe"), torch.get_num_threads()
    try:
        out = [decode_steps(make_runner(path, num_threads=n), WIDE, 2)[0] for n in (1, 3)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_sparse_moe_prompt_rows_shared_by_the_team(
    family_model_factory: Callable[..., Path],
) -> None:
    """A bf16 Qwen3-MoE's 300-token prompt through the step on AMX tiles, where the team
    shares the residual rows (from 224 rows, two threads): the experts read the team's
    normed rows (each expert's ~75 in the team's bf16 copy) and each thread adds its
    share's outputs, the bits of one thread's."""
    path = family_model_factory("qwen3_moe", hidden_size=128, num_attention_heads=4, head_dim=64)
    out = []
    for threads in (2, 1):
        runner = make_runner(path, dtype="bfloat16", num_pages=80)
        fused = runner.fused
        assert fused is not None
        if fused.max_new < 300:
            pytest.skip(f"the {fused.isa} build takes {fused.max_new} rows of a prompt")
        fused.threads.options = lambda n=threads: [n]  # type: ignore[method-assign]
        step = [SeqSpec(LONG[0][:300], 0, list(range(40)))]
        assert fused.accepts(step)
        out.append(runner.run(step))
    assert torch.equal(out[0], out[1])
    # and near the model's own bf16 forward: the experts' rows the team rounded are the
    # rows each expert took (measured 0.54 of logits up to 15; an expert reading the
    # copy one row off, 21.6)
    plain = make_runner(path, dtype="bfloat16", num_pages=80, fused_decode_max_batch=0)
    want = plain.run([SeqSpec(LONG[0][:300], 0, list(range(40)))])
    assert (out[0] - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_windowed_extensions(
    family_model_factory: Callable[..., Path], tiny_model_factory: Callable[..., Path], name: str
) -> None:
    """Rows of one sequence over a cached prefix longer than the window (a follow-up
    turn's tokens), beside decodes: each row attends to its own window's keys, as the
    model's forward does (Mistral with a 16-key window on every layer)."""
    path = (
        family_model_factory(name)
        if name == "gemma3"
        else tiny_model_factory("mistral", sliding_window=16)
    )
    fused, plain = make_runner(path), make_runner(path, fused_decode_max_batch=0)
    assert fused.fused is not None and fused.fused.step.weights.windowed
    a, b = list(range(0, 8)), list(range(8, 16))
    prompts = [SeqSpec(LONG[1][:40], 0, a), SeqSpec(PROMPTS[0], 0, b)]
    steps = [
        [SeqSpec(LONG[1][40:52], 40, a), SeqSpec([7], len(PROMPTS[0]), b)],  # 12 rows, a decode
        [SeqSpec(LONG[1][52:53], 52, a), SeqSpec([8, 9, 10], len(PROMPTS[0]) + 1, b)],
    ]
    for r in (fused, plain):
        r.run(prompts)
    for step in steps:
        assert fused.fused.accepts(step)
        got, want = fused.run(step), plain.run(step)
        assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("name,head_dim", [("gemma2", 32), ("gemma3", 32), ("gemma3", 64)])
def test_windowed_and_capped_rows_attend_together(
    family_model_factory: Callable[..., Path], name: str, head_dim: int
) -> None:
    """Over a bf16 pool a sequence's new tokens attend together within their windows
    (each row from its own window's first key; blocks before the first row's window
    skipped) and with capped scores (Gemma 2): in the builds with AVX512-BF16 on bf16
    products (flash.h: AMX tiles at D = 64 where granted, else dot products), elsewhere
    in fp32 (flash_f32.h); what they give a row at a time within bf16 rounding."""
    path = family_model_factory(name, hidden_size=128, num_attention_heads=4, head_dim=head_dim)
    runner = make_runner(path, dtype="bfloat16", num_pages=400)
    fused = runner.fused
    assert fused is not None
    a, b = list(range(0, 60)), list(range(60, 80))
    runner.run([SeqSpec(LONG[1][:300], 0, a), SeqSpec(PROMPTS[0], 0, b)])  # the forward
    steps = [
        [SeqSpec(LONG[0][:24], 300, a), SeqSpec([7], 41, b)],  # 24 rows over 300 cached
        [SeqSpec(LONG[0][24:33], 324, a), SeqSpec(LONG[0][60:72], 42, b)],  # 9 and 12
    ]
    if fused.max_new == FusedDecoder.MAX_NEW:  # on tiles: 300 rows, blocks of 256 keys
        steps.append([SeqSpec(LONG[0][100:400], 333, a)])
    assert all(together_against_rowwise(runner, steps))  # they did attend together


def test_gelu_on_tiles_gives_the_expanded_weights_bits(
    family_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 Gemma's step of 240 rows on AMX tiles: gate and up meet tanh-GELU in the
    tiles' epilogue, to the bit what the step without tiles computes."""
    path = family_model_factory("gemma3", hidden_size=256, num_attention_heads=4, head_dim=64)
    tiled = make_runner(path, dtype="bfloat16", quantization="none", num_pages=400)
    if tiled.fused is None or not tiled.fused.step.tiles:
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    monkeypatch.setattr(FusedDecoder, "AMX_TILES", False)
    expanded = make_runner(path, dtype="bfloat16", quantization="none", num_pages=400)
    assert expanded.fused is not None and not expanded.fused.step.tiles
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(15)]  # 15 sequences, 64 tokens
    prompts = [SeqSpec(LONG[1][i : i + 20], 0, t) for i, t in enumerate(tables)]
    step = [SeqSpec(LONG[1][i + 20 : i + 36], 20, t) for i, t in enumerate(tables)]
    for r in (tiled, expanded):
        r.fused.threads.options = lambda: [2]  # type: ignore[union-attr,method-assign]
        r.run(prompts)
    assert tiled.fused.accepts(step)  # 240 rows: the team's bf16 rows, the SiLU/GELU epilogue
    assert torch.equal(tiled.run(step), expanded.run(step))


def test_a_plugins_attention_backend_sees_every_step(tiny_llama: Path) -> None:
    class Recording(TorchNativeBackend):
        pass

    runner = make_runner(tiny_llama)
    backend = Recording(runner.pool, runner.info.num_heads, runner.info.head_dim)
    decoder, why = FusedDecoder.build(runner.model, backend, 8)
    assert decoder is None and why == "attention backend Recording"


@pytest.mark.parametrize(
    "prompts", [PROMPTS, LONG[:2], [LONG[0], [9]]], ids=["short", "long", "skewed"]
)
def test_results_do_not_depend_on_the_thread_count(
    tiny_llama: Path, prompts: list[list[int]]
) -> None:
    """Each output column and each (sequence, head) is one thread's whole job, and the
    norms are computed alike by every thread: 1 or 3 threads give the same bits. The
    (sequence, head) tasks go to the threads by their contexts' lengths: a context of
    1,200 tokens beside one of 1 leaves a thread of 3 no attention at all."""
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 3):
            out.append(decode_steps(make_runner(tiny_llama, num_threads=threads), prompts, 3)[0])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


SPIN_A_MINUTE = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"


def test_a_team_whose_threads_lose_their_cores_gives_the_same_bits(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Busy processes on every core take the team's threads off their cores mid-phase,
    so teammates wait at the barrier for one that has no core (cpu_step.c's team_wait
    then yields its own); every step must still finish, with the bits of an undisturbed
    run. The actors beside a worker do this to it at every token."""
    monkeypatch.setattr(ThreadChooser, "options", lambda self: [2])  # always a team of 2
    runner = make_runner(tiny_llama, num_threads=2)
    want = decode_steps(runner, PROMPTS, 3)[0]
    busy = [
        # each ends by itself within a minute, should this process be killed first
        subprocess.Popen([sys.executable, "-c", SPIN_A_MINUTE])
        for _ in range(len(os.sched_getaffinity(0)))  # every core this process may use
    ]
    try:
        got = decode_steps(make_runner(tiny_llama, num_threads=2), PROMPTS, 3)[0]
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_team_size_follows_the_measured_step_times() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    E = ThreadChooser.EXPLORE
    try:
        chooser = ThreadChooser()
        assert chooser.options() == [4, 2]

        def run(steps: int, times: dict[int, float], rows: int = 1) -> list[int]:
            picks = []
            for _ in range(steps):
                t = chooser.pick(rows)
                picks.append(t)
                chooser.record(rows, t, times[t] * rows)  # the same time a row
            return picks

        slow = {4: 0.010, 2: 0.004}  # a busy machine: the smaller team is faster
        picks = run(400, slow)
        assert picks[:E] == [4] * (E - 1) + [2]  # the whole team, then one look
        looks = [i for i, t in enumerate(picks) if t == 4 and i >= E]  # back, less often
        gaps = [b - a for a, b in zip([E - 1, *looks], looks, strict=False)]
        assert gaps == [E, 2 * E, 4 * E, 128, 128], gaps  # while it stays slower
        quiet = {4: 0.002, 2: 0.004}  # the load went away: seen at the next look
        run(ThreadChooser.EXPLORE_MAX, quiet)
        assert run(400, quiet) == [4] * 400  # quiet, and both known: no more looks
        loaded = {4: 0.006, 2: 0.004}  # the whole team slows: the other is tried again
        picks = run(2 * E, loaded)
        assert picks[E - 1 : 2 * E - 1] == [2] * E, picks  # at the next look
        busy = {4: 0.0045, 2: 0.004}  # within CLEARLY: looked at every EXPLORE steps
        picks = run(64, busy)
        assert 3 <= picks.count(4) <= 6, picks

        # sizes: each row count to EXACT, then by the power of two above (timed a row)
        assert chooser.pick(3) == 4  # each size learns on its own
        chooser = ThreadChooser()
        assert run(3, slow, rows=2) == [4] * 3  # a size seen a few times: no look
        assert run(4 * E, quiet, rows=300) == [4] * 4 * E  # a prompt's: none while quiet
        assert run(E, slow)[-1] == 2  # load, found by a decode batch size
        assert run(E, slow, rows=500) == [4] * (E - 1) + [2]  # now prompts look too:
        assert run(E, slow, rows=300) == [2] * (E - 1) + [4]  # 300 and 500 rows: one size
        assert run(E, slow, rows=1000) == [4] * (E - 1) + [2]  # 1,000 another
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("head", ["model", "ties", "nan"])
def test_the_step_finds_each_rows_argmax(
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    head: str,
) -> None:
    """The argmax each thread finds over its columns of the logits as the head makes
    them, merged, is torch.argmax of the step's logits: on the model's own head, on one
    whose every row is the same (every logit ties: the first token), and on one with NaN
    rows in both threads' columns (the first NaN)."""
    path = tiny_llama
    if head != "model":
        model = hf_model(tiny_llama)
        with torch.no_grad():
            w = model.get_output_embeddings().weight
            vocab = w.shape[0]
            if head == "ties":
                w.copy_(w[7].expand_as(w))
            else:
                w[vocab - 3] = w[vocab // 2 + 1] = w[vocab - 9] = float("nan")
        path = tmp_path / head
        model.save_pretrained(str(path))
        for f in tiny_llama.glob("tokenizer*"):
            (path / f.name).write_bytes(f.read_bytes())
    runner = make_runner(path)
    fused = runner.fused
    assert fused is not None
    monkeypatch.setattr(fused.threads, "pick", lambda batch: threads)
    pages = iter(range(runner.pool.num_pages))
    tables = [[next(pages) for _ in range(4)] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        runner.run([SeqSpec(p, 0, tables[i])])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(3):  # tokens of their own: a NaN row's embedding would spread
        seqs = [SeqSpec([3 + step], len(p) + step, tables[i]) for i, p in enumerate(PROMPTS)]
        logits = fused.run(seqs, None, lambda lg, picks: seen.append((lg, picks)))
        assert seen[-1][0] is logits
    for logits, picks in seen:
        assert torch.equal(picks, logits.argmax(dim=-1))
        if head == "ties":
            assert picks.tolist() == [0] * len(PROMPTS)
        if head == "nan":
            assert picks.tolist() == [vocab // 2 + 1] * len(PROMPTS)


def test_a_greedy_step_hands_the_sampler_its_argmax(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``ModelRunner.forward``: a decode step whose rows are all greedy gives the
    sampler the step's own argmax, and its tokens are those picks; a step with a sampled
    row (temperature 1) asks for none."""
    from actorlm.messages.sampling import SamplingParams
    from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

    runner = make_runner(tiny_llama)
    offers: list[torch.Tensor] = []
    own = runner.sampler.offer_argmax
    monkeypatch.setattr(
        runner.sampler, "offer_argmax", lambda lg, picks: offers.append(picks) or own(lg, picks)
    )
    prompts = {"g": PROMPTS[0], "h": PROMPTS[1], "s": PROMPTS[3]}
    temps = {"g": 0.0, "h": 0.0, "s": 1.0}
    tables = {rid: [i * 4 + j for j in range(4)] for i, rid in enumerate(prompts)}

    def init(rid: str) -> SeqInit:
        p = SamplingParams(temperature=temps[rid], seed=1)
        return SeqInit(sampling=p, token_ids=prompts[rid], prompt_len=len(prompts[rid]))

    def step(n: int, rids: list[str], first: bool) -> dict[str, int]:
        seqs = [
            SeqStep(r, prompts[r], 0, tables[r], True, init(r))
            if first
            else SeqStep(r, [last[r]], len(prompts[r]), tables[r])
            for r in rids
        ]
        res = runner.forward(ForwardBatch(step_id=n, seqs=seqs, release=[]))
        return {r.rid: r.token_id for r in res.results}

    last = step(1, list(prompts), True)
    offers.clear()
    greedy = step(2, ["g", "h"], False)
    assert len(offers) == 1 and offers[0].tolist() == [greedy["g"], greedy["h"]]
    step(3, ["g", "s"], False)
    assert len(offers) == 1
