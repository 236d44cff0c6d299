"""Hardware platforms: what the worker asks about the device it runs on.

One base class holds both the device identity and the serving defaults (SGLang
splits them into a device mixin and a platform; one class is enough here). A
platform plugin subclasses ``Platform`` and returns its class path from its
``activate()``; ``actorlm.extensions.plugins.current_platform()`` picks one.

The built-ins are registered in ``extensions.points.PLATFORMS`` by path (see
``extensions.plugins``), and torch is imported inside methods, so importing
this module costs nothing on a machine that never asks.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform as _stdlib_platform
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from ..config import DEFAULT_MAX_PREFILL_TOKENS

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig

__all__ = ["CpuPlatform", "CudaPlatform", "Platform"]

# Present whenever torch.cuda could see a device: the NVIDIA driver, or ROCm's
# kernel driver (ROCm builds of torch answer through torch.cuda too).
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/kfd")


class Platform:
    """A device family. Override what differs; the defaults describe a plain CPU."""

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # torch device type
    distributed_backend: ClassVar[str] = "gloo"  # torch.distributed backend
    # Dotted paths so a platform can swap them without importing them here.
    kv_pool_class: ClassVar[str] = "actorlm.gpu.kv_pool:KVPool"
    page_allocator_class: ClassVar[str] = "actorlm.actors.cache.allocator:PageAllocator"
    page_size: ClassVar[int] = 16  # default KV page size in tokens

    @classmethod
    def is_available(cls) -> bool:
        """Whether this machine has the hardware (used to pick a built-in)."""
        return True

    def torch_device(self, index: int = 0) -> torch.device:
        import torch

        return torch.device(self.device_type, index)

    def set_device(self, index: int = 0) -> None:
        """Make ``index`` the process's current device (no-op where there is one)."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def device_name(self, index: int = 0) -> str:
        raise NotImplementedError

    def total_memory(self, index: int = 0) -> int:
        """Bytes of device memory."""
        raise NotImplementedError

    def memory_usage(self, index: int = 0) -> int:
        """Bytes of device memory this process uses now."""
        raise NotImplementedError

    def default_attention_backend(self) -> str:
        return "torch"

    def default_quantization(self, dtype: str) -> str:
        return "none"

    def default_dtype(self) -> str:
        """The compute dtype ``--dtype auto`` runs."""
        return "float32"

    def kernel_isa(self) -> str:
        """The instruction set the platform's native kernels run ("" where it has none)."""
        return ""

    def default_max_prefill_tokens(self) -> int:
        """The scheduler's per-step token budget (chunked prefill) when the user sets none."""
        return DEFAULT_MAX_PREFILL_TOKENS

    def supports_graphs(self) -> bool:
        """Whether decode steps can be captured as device graphs (CUDA graphs)."""
        return False

    def adjust_defaults(self, config: EngineConfig) -> EngineConfig:
        """Fill the settings the user left to the platform ("" means "you choose")."""
        model = config.model
        changes: dict[str, Any] = {}
        if not model.device:
            changes["device"] = self.device_type
        dtype = model.dtype
        if dtype == "auto":
            dtype = changes["dtype"] = self.default_dtype()
        if not model.attention_backend:
            changes["attention_backend"] = self.default_attention_backend()
        if not model.quantization:
            changes["quantization"] = self.default_quantization(dtype)
        if model.page_size <= 0:
            changes["page_size"] = self.page_size
        scheduler = config.scheduler
        if scheduler.max_prefill_tokens <= 0:
            scheduler = msgspec.structs.replace(
                scheduler, max_prefill_tokens=self.default_max_prefill_tokens()
            )
        if not changes and scheduler is config.scheduler:
            return config
        return msgspec.structs.replace(
            config, model=msgspec.structs.replace(model, **changes), scheduler=scheduler
        )

    def describe(self) -> dict[str, Any]:
        """A summary for ``actorlm plugins`` and ``/get_server_info``."""
        info: dict[str, Any] = {
            "name": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "device_type": self.device_type,
            "distributed_backend": self.distributed_backend,
            "supports_graphs": self.supports_graphs(),
            "dtype_auto": self.default_dtype(),
            "kernel_isa": self.kernel_isa(),
        }
        with contextlib.suppress(Exception):  # a summary must not fail on odd hardware
            info["device_name"] = self.device_name()
            info["total_memory"] = self.total_memory()
        return info

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.name!r}>"


class CpuPlatform(Platform):
    name = "cpu"

    def torch_device(self, index: int = 0) -> torch.device:
        import torch

        return torch.device("cpu")  # one device; "cpu:0" would compare unequal to it

    def device_name(self, index: int = 0) -> str:
        # /proc/cpuinfo names the model on Linux; the stdlib knows only the architecture.
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return _stdlib_platform.processor() or _stdlib_platform.machine()

    def total_memory(self, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_usage(self, index: int = 0) -> int:
        # Resident set size now (getrusage would give the peak).
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def default_attention_backend(self) -> str:
        # torch, with decodes in a C kernel over the pages (falls back to torch's own
        # decode where no C compiler is found)
        return "cpu"

    def default_max_prefill_tokens(self) -> int:
        # A step's prefill chunk should take about the same time on any CPU: on 2 cores
        # 256 tokens of the default model take ~0.5 s, so a burst of new prompts delays
        # running decodes (and each other's first token) by that much per step, where
        # one 2048-token step would stall everything for ~4.5 s (bench/serving.py).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
        return min(DEFAULT_MAX_PREFILL_TOKENS, max(256, 128 * cores))

    def default_quantization(self, dtype: str) -> str:
        # A GGUF's own blocks for decode (a fifth of fp32's bytes); for prefill and for
        # weights of other formats fbgemm's fp16-weight GEMM in float32, torch's bf16
        # GEMM in bfloat16 (bench/forward.py).
        from .quantization import fbgemm_available

        if dtype == "bfloat16" or (dtype == "float32" and fbgemm_available()):
            return "gguf"
        return "none"

    def default_dtype(self) -> str:
        # bf16 where the CPU multiplies it natively (AMX or AVX512-BF16: oneDNN's bf16
        # GEMMs run ~4x its fp32 ones, bench/forward.py), fp32 elsewhere: without them
        # torch emulates bf16 and prefill runs slower than in fp32. vLLM's CPU choice.
        return "bfloat16" if self.native_bf16() else "float32"

    @staticmethod
    def native_bf16() -> list[str]:
        """This CPU's bf16 arithmetic units (cpu flags), empty where it has none."""
        from .kernels import native

        return sorted(native.cpu_flags() & {"amx_bf16", "avx512_bf16"})

    def kernel_isa(self) -> str:
        from .kernels import native

        return native.best_isa().name

    def describe(self) -> dict[str, Any]:
        from .kernels import native

        flags = native.cpu_flags()
        wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
        return {**super().describe(), "cpu_flags": [f for f in wanted if f in flags]}


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    distributed_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        # Every actor process asks (to pick the platform), and importing torch costs
        # seconds of CPU; with no GPU driver on the machine the answer is no anyway.
        if "torch" not in sys.modules and not any(os.path.exists(p) for p in _GPU_DRIVER_PATHS):
            return False
        import torch

        return bool(torch.cuda.is_available())

    def set_device(self, index: int = 0) -> None:
        import torch

        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def device_name(self, index: int = 0) -> str:
        import torch

        return str(torch.cuda.get_device_name(index))

    def total_memory(self, index: int = 0) -> int:
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory)

    def memory_usage(self, index: int = 0) -> int:
        # What torch's allocator holds for live tensors; the driver's view
        # (mem_get_info) also counts other processes.
        import torch

        return int(torch.cuda.memory_allocated(index))

    def default_attention_backend(self) -> str:
        # flashinfer only where it imports and a backend by that name is registered;
        # a CUDA machine without it still serves with the torch reference backend.
        from ..extensions.points import ATTENTION_BACKENDS
        from . import attention  # noqa: F401  (registers the built-in backends, lazily)

        if "flashinfer" not in ATTENTION_BACKENDS:
            return "torch"
        try:
            importlib.import_module("flashinfer")
        except Exception:  # ImportError, or a broken CUDA toolchain raising anything
            return "torch"
        return "flashinfer"

    def supports_graphs(self) -> bool:
        return True
