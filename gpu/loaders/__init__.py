"""Weight loaders, registered lazily by ``--load-format`` name (no torch import here)."""

from actorlm.extensions.points import WEIGHT_LOADERS

__all__: list[str] = []

WEIGHT_LOADERS.register_builtin(
    "safetensors",
    "actorlm.gpu.loaders.safetensors:SafetensorsLoader",
    help="HF folder, a shard at a time",
)
WEIGHT_LOADERS.register_builtin(
    "layered",
    "actorlm.gpu.loaders.layered:LayeredLoader",
    help="HF folder, a tensor at a time (low peak memory)",
)
WEIGHT_LOADERS.register_builtin(
    "gguf", "actorlm.gpu.loaders.gguf:GGUFLoader", help="llama.cpp GGUF, dequantized"
)
