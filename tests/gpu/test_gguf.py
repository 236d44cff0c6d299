"""The embedded default model (SmolLM2-135M Q4_1 GGUF) against transformers loading the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from actorlm.gpu.gguf_file import GGUFFile
from actorlm.gpu.loaders.gguf import gguf_tensor_name, unpermute_rope_rows
from actorlm.gpu.model_info import kv_bytes_per_token, kv_pages_for_budget, load_model_info

from .helpers import Pages, greedy, hf_greedy, make_runner


def test_model_info_from_gguf_metadata(default_gguf: Path) -> None:
    info = load_model_info(default_gguf)
    assert (info.architecture, info.num_layers, info.num_heads, info.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
    )
    assert (info.head_dim, info.vocab_size, info.max_model_len) == (64, 49152, 8192)
    assert (info.eos_token_ids, info.bos_token_id, info.tie_word_embeddings) == ([2], 1, True)
    assert kv_bytes_per_token(info, "float32") == 2 * 30 * 3 * 64 * 4
    assert kv_pages_for_budget(info, 2**30, 16, "float32") == 2**30 // (46080 * 16)
    with pytest.raises(ValueError, match="holds no page"):
        kv_pages_for_budget(info, 1000, 16, "float32")


def test_model_info_from_hf_folder(tiny_llama: Path) -> None:
    info = load_model_info(tiny_llama)
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == (
        "LlamaForCausalLM",
        2,
        2,
        16,
    )
    assert (info.eos_token_ids, info.bos_token_id, info.source_format) == ([2], 1, "safetensors")


def test_gguf_names_and_unpermute(default_gguf: Path) -> None:
    f = GGUFFile(default_gguf)
    assert gguf_tensor_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert gguf_tensor_name("rope_freqs.weight") is None
    assert f.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    # llama.cpp's permutation: per head, row pairs (2i, 2i+1) come from HF rows (i, i + D/2)
    hf = np.arange(2 * 8, dtype=np.float32).reshape(16, 1)  # two heads of dim 8
    llama_cpp = hf.reshape(2, 2, 4, 1).swapaxes(1, 2).reshape(16, 1)
    assert np.array_equal(unpermute_rope_rows(llama_cpp, 2), hf)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_gguf_greedy_64_matches_transformers(
    default_gguf: Path, default_gguf_transformers: Any, tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(
        prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    )
    want = hf_greedy(default_gguf_transformers, prompt, 64)
    # fp32 weights as loaded, rounded to fp16, and the CPU default: the file's blocks
    # for decode, fp16 for the prompt
    for quantization in ("none", "fp16", "gguf"):
        runner = make_runner(default_gguf, num_pages=64, quantization=quantization)
        ours = greedy(runner, "g", prompt, 64, Pages())
        assert ours == want, (quantization, tok.decode(ours))
