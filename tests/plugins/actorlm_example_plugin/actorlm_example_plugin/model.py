"""A model architecture: config.json ``"architectures": ["ExampleLlamaForCausalLM"]``."""

from __future__ import annotations

from actorlm.gpu.model_info import ModelInfo
from actorlm.gpu.models.llama import LlamaForCausalLM

from .record import record

__all__ = ["ExampleLlamaForCausalLM"]


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    """The built-in Llama; a real plugin would change layers or weight names here."""

    def __init__(self, info: ModelInfo, max_model_len: int | None = None) -> None:
        super().__init__(info, max_model_len=max_model_len)
        record("model.init")
