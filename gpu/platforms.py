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
import importlib.util
import os
import platform as _stdlib_platform
import sys
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from ..config import DEFAULT_MAX_PREFILL_TOKENS

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig, ModelConfig
    from .model_info import ModelInfo

__all__ = [
    "CUDA_ONLY_ATTENTION_BACKENDS",
    "CpuPlatform",
    "CudaPlatform",
    "Platform",
    "device_platform",
    "estimate_weight_bytes",
    "resolve_dtype",
]

# Built-in attention backends whose kernels are GPU code: asking for one on another
# device is refused when the config is resolved, before any actor starts.
CUDA_ONLY_ATTENTION_BACKENDS = ("flashinfer", "triton")
DEFAULT_KV_CACHE_GB = 1.0  # the KV budget where neither the user nor the device decides
DEFAULT_MEM_FRACTION_STATIC = 0.88  # CUDA: weights + KV pool; the rest for activations
MAX_GRAPH_BATCH = 256
CUDA_MAX_PREFILL_TOKENS = 8192

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

    def free_memory(self, index: int = 0) -> int:
        """Bytes of device memory free now (for every process)."""
        raise NotImplementedError

    def default_attention_backend(self) -> str:
        return "torch"

    def kv_cache_bytes(self, model: ModelConfig, info: ModelInfo) -> int:
        """The KV pool's budget when ``--num-pages`` is not given (``model`` resolved)."""
        return int((model.kv_cache_gb or DEFAULT_KV_CACHE_GB) * 2**30)

    def check_config(self, config: EngineConfig) -> None:
        """Refuse, in one line (a ValueError), what cannot run here; called on the
        resolved config before any actor starts."""
        m = config.model
        if m.attention_backend in CUDA_ONLY_ATTENTION_BACKENDS and not m.device.startswith("cuda"):
            raise ValueError(
                f"attention backend {m.attention_backend!r} runs on CUDA devices only, and this "
                f"machine's platform is {self.name} (device {m.device!r}); use "
                f"--attention-backend {self.default_attention_backend()} or torch"
            )

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

    def default_decode_page_run(self) -> int:
        """A decode's KV pages the scheduler asks for at a time when the user sets none:
        one where reading pages apart costs nothing more (device memory)."""
        return 1

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
        if dtype in ("", "auto"):
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
        if scheduler.decode_page_run <= 0:
            scheduler = msgspec.structs.replace(
                scheduler, decode_page_run=self.default_decode_page_run()
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

    def default_decode_page_run(self) -> int:
        # A decode's pages taken one at a time land between other sequences' (2 KB of K
        # and of V a KV head for the default model), and the CPU's prefetcher follows
        # only runs of a few pages: decode attention of 32 sequences over 800 tokens
        # 40-43 ms a step of pages scattered one by one, 33-37 in runs of 8 (~30
        # sequential), 8 over 800 10.7-11.1 against 9.7-10.3 (bench/attention.py
        # --pages, 2-core AMX Xeon); runs of 16 and 32 gained little more.
        return 8

    def default_quantization(self, dtype: str) -> str:
        # A GGUF's own blocks for decode (a fifth of fp32's bytes); for prefill and for
        # weights of other formats fbgemm's fp16-weight GEMM in float32, torch's bf16
        # GEMM in bfloat16 (bench/forward.py).
        from .quantization import fbgemm_available

        if dtype == "bfloat16" or (dtype == "float32" and fbgemm_available()):
            return "gguf"
        return "none"

    def adjust_defaults(self, config: EngineConfig) -> EngineConfig:
        left = config.model.dtype in ("", "auto") and not config.model.quantization
        out = super().adjust_defaults(config)
        if left and out.model.quantization == "gguf" and self.int8_rows_fastest():
            # --dtype auto: the CPU's fastest units, as bf16 is where it has them. On
            # AVX512-VNNI without bf16 those are the int8 dot products: the default
            # model's decode at 1 / 8 / 32 rows 178 / 584 / 632 tok/s against fp32's
            # 109 / 357 / 345, a 512-token prompt 837 against 590 (bench/forward.py,
            # 2-core Ice Lake Xeon, 2026-12-07). --dtype float32 keeps the exact path.
            model = msgspec.structs.replace(out.model, quantization="gguf_a8")
            out = msgspec.structs.replace(out, model=model)
        if (
            config.scheduler.max_prefill_tokens <= 0
            and out.model.dtype == "bfloat16"
            and "amx_bf16" in self.native_bf16()
        ):
            # AMX prefills bf16 ~4x faster than the fp32 the budget was set by: twice the
            # tokens a step raised random-workload c=32 throughput ~17% at the same TTFT
            # p50 on a 2-core Xeon (four times: +23%, TTFT p50 +15-30%; bench/serving.py)
            budget = 2 * out.scheduler.max_prefill_tokens
            out = msgspec.structs.replace(
                out, scheduler=msgspec.structs.replace(out.scheduler, max_prefill_tokens=budget)
            )
        return out

    def default_dtype(self) -> str:
        # bf16 where the CPU multiplies it natively (AMX or AVX512-BF16: oneDNN's bf16
        # GEMMs run ~4x its fp32 ones, bench/forward.py), fp32 elsewhere: without them
        # torch emulates bf16 and prefill runs slower than in fp32. vLLM's CPU choice.
        return "bfloat16" if self.native_bf16() else "float32"

    @staticmethod
    def int8_rows_fastest() -> bool:
        """Whether int8 rows (the ``*_a8`` methods) are this CPU's fastest arithmetic:
        AVX512-VNNI's dot products (the avx512vnni build) where it has no native bf16."""
        from .kernels import native

        return native.best_isa().name == "avx512vnni"

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
        out = {**super().describe(), "cpu_flags": [f for f in wanted if f in flags]}
        if native.best_isa().name == "amx":  # the kernel may refuse the tiles (arch_prctl)
            from .kernels import qgemm

            out["amx_tiles"] = qgemm.amx_ready()
        return out


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

    def device_capability(self, index: int = 0) -> tuple[int, int]:
        """(major, minor) compute capability: 8.0 A100, 8.9 L4/L40, 9.0 H100/H200."""
        import torch

        major, minor = torch.cuda.get_device_capability(index)
        return int(major), int(minor)

    def total_memory(self, index: int = 0) -> int:
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory)

    def memory_usage(self, index: int = 0) -> int:
        # What torch's allocator holds for live tensors; the driver's view
        # (mem_get_info) also counts other processes.
        import torch

        return int(torch.cuda.memory_allocated(index))

    def free_memory(self, index: int = 0) -> int:
        # The driver's count: other processes' memory, and this one's CUDA context, are
        # already taken out of it.
        import torch

        return int(torch.cuda.mem_get_info(index)[0])

    def default_dtype(self) -> str:
        # bf16 where the tensor cores have it (Ampere on); fp16 before
        return "bfloat16" if self.device_capability() >= (8, 0) else "float16"

    def default_attention_backend(self) -> str:
        # triton where it imports (sm70+), then flashinfer (sm75+), then the torch
        # reference backend, which any CUDA machine runs. triton first: its backend has
        # passed the GPU tests on a GPU (an H200, bench/README.md); flashinfer's is
        # written to its documented API but has not run on one yet (--attention-backend
        # flashinfer asks for it).
        from ..extensions.points import ATTENTION_BACKENDS
        from . import attention  # noqa: F401  (registers the built-in backends, lazily)

        capability = self.device_capability()
        for name, module, least in (
            ("triton", "triton", (7, 0)),
            ("flashinfer", "flashinfer", (7, 5)),
        ):
            if name in ATTENTION_BACKENDS and capability >= least and _imports(module):
                return name
        return "torch"

    def supports_graphs(self) -> bool:
        return True

    def default_max_prefill_tokens(self) -> int:
        # A data-center GPU runs 8k tokens of an 8B model's prefill in ~50 ms: a smaller
        # chunk leaves its matmuls short of full speed, a larger one stalls decodes longer.
        return CUDA_MAX_PREFILL_TOKENS

    def adjust_defaults(self, config: EngineConfig) -> EngineConfig:
        backend_open = not config.model.attention_backend
        config = super().adjust_defaults(config)
        m = config.model
        changes: dict[str, Any] = {}
        if backend_open and m.attention_backend == "flashinfer" and m.dtype == "float32":
            # flashinfer runs 16-bit KV only; --dtype float32 still gets a CUDA kernel
            changes["attention_backend"] = "triton" if _imports("triton") else "torch"
        if m.cuda_graph_max_bs <= 0:
            changes["cuda_graph_max_bs"] = min(
                MAX_GRAPH_BATCH, config.scheduler.max_running_requests
            )
        if not changes:
            return config
        return msgspec.structs.replace(config, model=msgspec.structs.replace(m, **changes))

    def kv_cache_bytes(self, model: ModelConfig, info: ModelInfo) -> int:
        """``--kv-cache-gb`` if given; else SGLang's rule: weights and KV pool take
        ``--mem-fraction-static`` of the device, counting what others hold already."""
        if model.kv_cache_gb > 0 or not model.device.startswith("cuda"):
            return super().kv_cache_bytes(model, info)
        import torch

        index = torch.device(model.device or "cuda").index or 0
        total, free = self.total_memory(index), self.free_memory(index)
        fraction = model.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        weights = estimate_weight_bytes(info, resolve_dtype(model.dtype, model.device))
        budget = int(free - weights - total * (1 - fraction))
        if budget <= 0:
            raise ValueError(
                f"no device memory left for the KV pool: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f}, weights ~{weights / 2**30:.1f} GiB, "
                f"--mem-fraction-static {fraction}; raise it or set --kv-cache-gb"
            )
        return budget

    def check_config(self, config: EngineConfig) -> None:
        super().check_config(config)
        m = config.model
        needs = {"flashinfer": "flashinfer-python", "triton": "triton"}
        if m.attention_backend in needs and not _imports(m.attention_backend):
            raise ValueError(
                f"attention backend {m.attention_backend!r} needs "
                f"`pip install {needs[m.attention_backend]}`"
            )
        if m.attention_backend == "flashinfer" and m.dtype not in ("float16", "bfloat16"):
            raise ValueError(
                f"attention backend 'flashinfer' runs float16/bfloat16 only, not {m.dtype}; "
                "use --dtype bfloat16 or --attention-backend triton"
            )

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        with contextlib.suppress(Exception):
            info["capability"] = ".".join(map(str, self.device_capability()))
        return info


def resolve_dtype(dtype: str, device: str) -> str:
    """``--dtype`` made concrete for a config that skipped ``resolve_config``: ``auto``
    is the choice of the platform that runs the device (``device_platform``), float32 on
    any other device."""
    if dtype not in ("", "auto"):
        return dtype
    kind = (device or "cpu").partition(":")[0]
    platform = device_platform(kind)
    return platform.default_dtype() if kind == platform.device_type else "float32"


def device_platform(device: str) -> Platform:
    """The platform that runs ``device`` ("" for the active platform's own): the active
    one, except that the CPU under an accelerator's platform (``--device cpu`` on a GPU
    machine) gets the CPU platform: the CPU's own dtype, kernels, attention backend and
    KV sizing, never a GPU backend it would then refuse."""
    from ..extensions.plugins import current_platform

    platform = current_platform()
    if device.partition(":")[0] == "cpu" and platform.device_type != "cpu":
        return CpuPlatform()
    return platform


def _imports(module: str) -> bool:
    """Whether ``module`` is installed and imports (a broken CUDA toolchain may raise anything)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def estimate_weight_bytes(info: ModelInfo, dtype: str) -> int:
    """A dense decoder's weights from its shape (for sizing the KV pool before loading;
    the runner checks the pool against the memory really free once weights are in)."""
    from .model_info import dtype_size

    h, q, kv = info.hidden_size, info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * info.intermediate_size + 2 * h
    embed = info.vocab_size * h * (1 if info.tie_word_embeddings else 2)
    return (info.num_layers * layer + embed + h) * dtype_size(dtype)
