"""Attention backends, registered lazily by name so importing this package loads no torch
and GPU-only code is imported only when asked for."""

from actorlm.extensions.points import ATTENTION_BACKENDS

__all__: list[str] = []

ATTENTION_BACKENDS.register_builtin(
    "torch",
    "actorlm.gpu.attention.torch_native:TorchNativeBackend",
    help="pure PyTorch, any device",
)
ATTENTION_BACKENDS.register_builtin(
    "cpu",
    "actorlm.gpu.attention.cpu:CpuBackend",
    help="torch, with decodes in a C kernel over the KV pages (the CPU default)",
)
ATTENTION_BACKENDS.register_builtin(
    "flashinfer",
    "actorlm.gpu.attention.flashinfer_backend:FlashInferBackend",
    help="FlashInfer's paged decode/prefill wrappers (CUDA, fp16/bf16; the CUDA default)",
)
ATTENTION_BACKENDS.register_builtin(
    "triton",
    "actorlm.gpu.attention.triton_backend:TritonBackend",
    help="Triton paged decode (split-KV) and extend kernels (CUDA)",
)
