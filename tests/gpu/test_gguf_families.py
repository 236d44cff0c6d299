"""Each new family's tiny model written as llama.cpp writes it (tests/gguf_models.py)
and loaded from the GGUF: logits and 32 greedy tokens against transformers on the
HF folder it came from. The MoE files hold Q8_0 experts, against a reference whose
experts are the same Q8_0 values; with the ``gguf`` linear method those experts
keep their blocks and decode through the block kernel. The tokenizer, chat
template and stop tokens come from the file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from actorlm.actors.tokenizer.tokenization import load_tokenizer
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.quantization import GGUFLinear
from actorlm.messages.generate import ChatMessage

from tests.gguf_models import write_gguf

from .helpers import Pages, greedy, hf_greedy, hf_last_logits, hf_model, make_runner

TOL = 1e-4
PROMPTS = [[(i * 7919) % 40000 + 100 for i in range(41)], [5, 17, 923, 4, 4, 88, 1200, 31, 7]]
# What llama.cpp's runtime assumes where its files are silent: Gemma's query scale is
# the head size (but for the 27B), Gemma 3 has one global layer in six.
GGUF_SHAPED = {
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"num_hidden_layers": 6, "layer_types": None},
}
Q8_EXPERTS = ("qwen3_moe", "mixtral")


def q8_0_round_trip(model: Any) -> Any:
    """The reference's experts replaced by their Q8_0 values (what the GGUF holds)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                w = p.detach().numpy().astype(np.float32)
                p.copy_(torch.from_numpy(dequantize(quantize(w, q8), q8).reshape(w.shape)))
    return model


@pytest.fixture(
    scope="module", params=["qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3"]
)
def gguf_family(
    request: pytest.FixtureRequest,
    family_model_factory: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path, Any]:
    folder = family_model_factory(request.param, **GGUF_SHAPED.get(request.param, {}))
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_gguf(folder, out, "Q8_0" if request.param in Q8_EXPERTS else "F32")
    ref = hf_model(folder)
    return request.param, out, q8_0_round_trip(ref) if request.param in Q8_EXPERTS else ref


def test_gguf_logits_and_greedy_match_transformers(gguf_family: tuple[str, Path, Any]) -> None:
    name, path, ref = gguf_family
    runner = make_runner(path, num_pages=128)
    assert runner.info.source_format == "gguf"
    pages = Pages()
    ours = runner.run([SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert (ours[i] - hf_last_logits(ref, prompt)).abs().max().item() < TOL, (name, i)
    assert greedy(runner, "g", PROMPTS[0], 32, pages) == hf_greedy(ref, PROMPTS[0], 32)


@pytest.mark.parametrize("name", Q8_EXPERTS)
def test_q8_0_experts_decode_through_the_block_kernel(
    name: str, family_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    folder = family_model_factory(name)
    path = write_gguf(folder, tmp_path / f"{name}.gguf", "Q8_0")
    runner = make_runner(path, num_pages=64, quantization="gguf")
    expert = runner.model.model.layers[0].mlp.experts[3]
    assert isinstance(expert.gate_up_proj, GGUFLinear) and expert.gate_up_proj.packed.kind == "q8_0"
    fused = runner.fused  # the fused step reads the same blocks
    assert fused is not None and all(x.moe is not None for x in fused.step.weights.layers)
    moes = [x.moe for x in fused.step.weights.layers if x.moe is not None]
    assert {lin.kind for moe in moes for pair in moe.experts for lin in pair} == {4}  # Q8_0
    ref = q8_0_round_trip(hf_model(folder))
    # decode rows (a few per expert) take the block kernel; the prompt runs fp16 weights
    assert greedy(runner, "g", PROMPTS[1], 16, Pages()) == hf_greedy(ref, PROMPTS[1], 16)


def test_tokenizer_template_and_stops_come_from_the_file(
    family_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_gguf(family_model_factory("gemma3"), tmp_path / "gemma3.gguf")
    tok = load_tokenizer(str(path), cache_root=tmp_path / "tokenizers")
    text = tok.render_chat([ChatMessage(role="user", content="Hi")])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    stops = tok.convert_ids_to_tokens(sorted(tok.eos_token_ids))
    assert {"<eos>", "<end_of_turn>"} <= set(stops)
