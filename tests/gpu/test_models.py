"""The Llama-family model against transformers, on tiny random models saved as safetensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.config import ModelConfig
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.loaders.base import load_model
from actorlm.gpu.runner import ModelRunner

from .helpers import Pages, greedy, hf_greedy, hf_last_logits, hf_model, make_runner

TOL = 1e-4  # fp32: same math, different op order; logits are O(10)
PROMPTS = [list(range(100, 141)), [5, 17, 923, 4, 4, 88, 1200, 31, 7], [42]]


@pytest.fixture(scope="module")
def qwen2_with_bias(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Tiny Qwen2 whose q/k/v biases are non-zero (random init leaves them at zero)."""
    src = tiny_model_factory("qwen2")
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


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def runner_and_reference(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> tuple[ModelRunner, Any]:
    """(our runner, the transformers model) on the same tiny checkpoint, one per architecture."""
    if request.param == "qwen2":
        path = request.getfixturevalue("qwen2_with_bias")
    else:
        path = tiny_model_factory(request.param)
    return make_runner(path), hf_model(path)


def test_logits_match_transformers(runner_and_reference: tuple[ModelRunner, Any]) -> None:
    runner, ref = runner_and_reference
    pages = Pages()
    # all three prompts in one ragged batch
    seqs = [SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(PROMPTS)]
    ours = runner.run(seqs)
    assert ours.shape == (len(PROMPTS), runner.info.vocab_size) and ours.dtype == torch.float32
    for i, prompt in enumerate(PROMPTS):
        diff = (ours[i] - hf_last_logits(ref, prompt)).abs().max().item()
        assert diff < TOL, f"prompt {i}: max abs diff {diff}"


def test_greedy_32_steps_match_transformers(runner_and_reference: tuple[ModelRunner, Any]) -> None:
    runner, ref = runner_and_reference
    prompt = PROMPTS[1]
    assert greedy(runner, "a", prompt, 32, Pages()) == hf_greedy(ref, prompt, 32)


def test_layered_loader_gives_identical_weights(tiny_llama: Path) -> None:
    full, _ = load_model(ModelConfig(path=str(tiny_llama), load_format="safetensors"))
    layered, _ = load_model(ModelConfig(path=str(tiny_llama), load_format="layered"))
    a, b = full.state_dict(), layered.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    runner = make_runner(tiny_llama, load_format="layered")
    diff = runner.run([SeqSpec(PROMPTS[0], 0, [0, 1, 2])])[0] - hf_last_logits(
        hf_model(tiny_llama), PROMPTS[0]
    )
    assert diff.abs().max().item() < TOL


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [1.0 + i for i in range(8)],
            "original_max_position_embeddings": 16,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(
    rope: dict, tiny_model_factory: Callable[..., Path]
) -> None:
    # a short trained context so a 41-token prompt runs past it (dynamic rescales there)
    path = tiny_model_factory(
        "llama", max_position_embeddings=32, rope_parameters={"rope_theta": 10000.0, **rope}
    )
    runner = make_runner(path, max_model_len=256)
    assert (
        runner.info.rope_scaling is not None
        and runner.info.rope_scaling["rope_type"] == rope["rope_type"]
    )
    ref = hf_model(path)
    # 41 tokens run past the 16 of the original context, 9 stay within it (LongRoPE's
    # short factors, YaRN's unscaled band)
    for i, prompt in enumerate(PROMPTS[:2]):
        ours = runner.run([SeqSpec(prompt, 0, [10 * i, 10 * i + 1, 10 * i + 2])])[0]
        assert (ours - hf_last_logits(ref, prompt)).abs().max().item() < TOL
    # both in one step: each sequence's rotation by its own length (dynamic's base, the
    # LongRoPE table), whatever shares the step
    both = runner.run(
        [SeqSpec(p, 0, [10 * i, 10 * i + 1, 10 * i + 2]) for i, p in enumerate(PROMPTS[:2])]
    )
    for prompt, ours in zip(PROMPTS[:2], both, strict=True):
        assert (ours - hf_last_logits(ref, prompt)).abs().max().item() < TOL
