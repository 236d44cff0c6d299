"""Random-weight models to benchmark on, built with ``transformers`` (no download).

    python bench/random_model.py qwen3 --out /tmp/tiny-qwen3           # a family's tiny test model
    python bench/random_model.py qwen3-0.6b --out /tmp/qwen3-0.6b       # Qwen3-0.6B's real shape
    python bench/random_model.py --list

A family name builds the tiny model the tests use (``tests/models.py``: 2-4 layers,
hidden 64, the family's real configuration otherwise, with its tokenizer); a
``-real`` shape builds the published configuration of a released model with random
weights (initializer 0.02) and no tokenizer (``bench/forward.py`` feeds token ids).
It prints a one-line JSON summary (path, architecture, parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/random_model.py` from anywhere
    sys.path.insert(0, str(REPO))

from tests.models import FAMILIES, build_family_model, build_tiny_model  # noqa: E402

# Released models' config.json values (the shapes; weights are random).
REAL_SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-270m": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
}
REAL_SHAPES["gemma3-1b"] = (  # the 270M's family, the 1B's sizes
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    {
        **REAL_SHAPES["gemma3-270m"][2],
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
    },
)

# Qwen3-30B-A3B's layout (128 experts, 8 a token, q/k norms) at a quarter of its widths
# and 12 of its 48 layers: ~1B parameters, ~0.2B active a token
REAL_SHAPES["qwen3-moe-a0.2b"] = (
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    dict(
        vocab_size=151936,
        hidden_size=1024,
        moe_intermediate_size=192,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
)


def build_real_shape(name: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    config_cls, model_cls, params = REAL_SHAPES[name]
    config = getattr(transformers, config_cls)(**params, initializer_range=0.02)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", help="a family (tiny) or a real shape")
    p.add_argument("--out", type=Path, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a config value of a tiny family model (max_position_embeddings=4096)",
    )
    p.add_argument("--list", action="store_true", help="the names this builds")
    args = p.parse_args()
    tiny = [*FAMILIES, "gpt_neox"]
    if args.list or not args.model:
        print("tiny families:", ", ".join(tiny))
        print("real shapes:", ", ".join(REAL_SHAPES))
        return
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model in REAL_SHAPES:
        build_real_shape(args.model, args.out, args.seed)
    elif args.model == "gpt_neox":  # not native: the transformers fallback's test model
        build_tiny_model(args.out, "gpt_neox", args.seed, rotary_pct=0.25)
    elif args.model in FAMILIES:
        overrides = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set)}
        build_family_model(args.out, args.model, args.seed, **overrides)
    else:
        p.error(f"unknown model {args.model!r}; known: {', '.join(tiny + list(REAL_SHAPES))}")
    config = json.loads((args.out / "config.json").read_text())
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(
        json.dumps(
            {"path": str(args.out), "architecture": config["architectures"][0], "params": size // 4}
        )
    )


if __name__ == "__main__":
    main()
