"""Linear methods: how a loaded model's linear layers compute (``--quantization``).

Weights load in the compute dtype as usual; a method then converts every
``nn.Linear`` of the model (and its LM head) after loading, the way SGLang's
``process_weights_after_loading`` does. Activations stay in the compute dtype.

Built in:

- ``none``: plain ``nn.Linear``, bit-for-bit the loaded weights.
- ``fp16``: weights stored as fp16 and packed for fbgemm's fp16 GEMM (PyTorch's
  x86 CPU kernels), activations and accumulation fp32. Half the memory traffic of
  fp32 and a GEMM tuned for the small-M shapes of decode; weights round to fp16
  (relative error ~5e-4, far below a GGUF model's 4-bit quantization: the default
  model's greedy tokens are unchanged).

- ``gguf``: a GGUF model's Q4_1 and Q8_0 weights kept as their 32-wide blocks,
  found bit-exact in the loaded weights (``qgemm.pack``: the weights load in fp32 for
  it, whatever the compute dtype); batches of up to ``GGUFLinear.KERNEL_MAX_ROWS``
  rows (decode; bf16 rows up to ``GGUFLinear.AMX_MAX_ROWS`` on AMX CPUs) run a C kernel
  that expands each block in registers (~5 bits read a weight, fp32 arithmetic on fp32
  activations, bf16 products on bf16 ones), larger ones (prefill) a
  dense GEMM: the ``fp16`` path in float32, oneDNN's bf16 GEMM (AMX or AVX512-BF16
  where the CPU has them; the dense copy packed once, ``onednn.py``) in bfloat16. A weight of another format runs
  the dense path throughout. The CPU platform's default: the default model decodes
  ~1.6x faster than with ``fp16`` at batch 1 and ~1.45x at batch 8 (bench/forward.py),
  same greedy tokens.

- ``q8_0``, ``q4_1``: any checkpoint (an HF model's bf16 or fp32 safetensors) rounded
  to those blocks as it loads, as llama.cpp's quantizer rounds them, then run as
  ``gguf`` runs a GGUF's blocks (prompts: a dense copy of the rounded weights, in the
  compute dtype, kept beside the blocks as ``gguf`` keeps one). Weights only:
  activations stay in the compute dtype. Decode reads 8.5 bits a weight for Q8_0
  (rounding off by at most ~1/254 of its block's largest magnitude), 5 for Q4_1 (~1/30
  of its block's range).

- ``gguf_a8``, ``q8_0_a8``, ``q4_1_a8``: the same blocks, every row they meet (prompts
  included: ``GGUFLinear.INT8_MAX_ROWS``) quantized to int8 per 32-wide block as
  llama.cpp's CPU path quantizes it, on AVX512-VNNI's int8 dot products
  (``kernels/dpi8.h``: the avx512vnni level and above; AVX2's byte products in the
  avx2 and avx512 builds, ``kernels/dpi8_avx2.h``), with no dense copy beside the
  blocks (the default model's worker holds ~275 MiB less). Where AMX runs bf16 rows,
  int8 rows are faster only in small batches: there batches of 9 or more rows (25
  over Q8_0, ``gemv.h``'s ``I8_AMX_MIN_ROWS``) run as ``gguf``'s do, on the tiles and,
  beyond ``AMX_MAX_ROWS``, on oneDNN over a dense copy the layers keep there. Not exact: the
  default model's first-token logits land ~0.6-1.3 from the exact fp32 path's (bf16
  rows: ~0.8), so near-ties may flip; decode at 8-64 rows runs ~1.4x ``gguf``'s on a
  Zen 4, at 1-8 rows ~1.2-1.6x on an AMX Xeon, at 1-32 rows ~1.6-1.8x on an Ice Lake
  (bench/README.md), whose ``--dtype auto`` runs ``gguf_a8`` (the CPU platform's
  ``adjust_defaults``: VNNI's int8 products are its fastest units, its bf16 emulated).
  The generic build (no AVX2) refuses them at start-up.

fbgemm's int8 path (W8A8 dynamic) quantizes activations per tensor to 7 bits; on the
default model greedy tokens change from the first one, so it is not offered.

A plugin adds a method with ``QUANTIZATION_METHODS.register(name, cls)``: a
``LinearMethod`` subclass whose ``convert`` turns a weight (and bias) into a module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from actorlm.extensions.points import QUANTIZATION_METHODS
from torch import nn

from .kernels import native, qgemm
from .kernels.qgemm import PackedWeight

__all__ = [
    "BlockQuantMethod",
    "Fp16Linear",
    "Fp16Method",
    "GGUFA8Method",
    "GGUFLinear",
    "GGUFMethod",
    "LinearMethod",
    "NoQuantization",
    "Q4_1A8Method",
    "Q4_1Method",
    "Q8_0A8Method",
    "Q8_0Method",
    "fbgemm_available",
    "native_lin",
    "quantize_model",
]


def fbgemm_available() -> bool:
    """Whether this PyTorch build has fbgemm's kernels (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class LinearMethod(ABC):
    name: ClassVar[str] = ""

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ValueError when the method cannot run on ``device`` in ``dtype``."""
        return  # runs anywhere unless a method says otherwise

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype weights load in before ``convert`` (the model's other parameters
        are cast to ``dtype`` after)."""
        return dtype

    @abstractmethod
    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """A module computing ``x @ weight.T + bias`` for ``x`` of shape [T, in]."""


class NoQuantization(LinearMethod):
    name = "none"

    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        raise AssertionError("quantize_model leaves a model alone under 'none'")


class Fp16Linear(nn.Module):
    """fp16 weights packed for fbgemm; fp32 in, fp32 out.

    A very wide layer (an LM head over a 50k vocabulary) is packed as shards of
    ``SHARD_ROWS`` output rows whose results are concatenated: fbgemm's fp16 GEMM
    runs ~1.5x faster on 4096-wide shards than on one 49152-wide weight at decode's
    batch sizes (bench: 21.7 → 14.1 ms at M=32 for SmolLM2's head).
    """

    SHARD_ROWS: ClassVar[int] = 4096

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.float()
        b = None if bias is None else bias.float()
        rows = self.SHARD_ROWS if w.shape[0] >= 3 * self.SHARD_ROWS else w.shape[0]
        self.shards = [
            torch.ops.quantized.linear_prepack_fp16(
                w[i : i + rows].contiguous(), None if b is None else b[i : i + rows].contiguous()
            )
            for i in range(0, w.shape[0], rows)
        ]
        self._lin: qgemm.Lin | None = None

    def lin(self) -> qgemm.Lin | None:
        """The fp16 weight as rows for the native kernels: an fp16 copy of what fbgemm
        packed, made on first use (the fused decode step), then kept."""
        if self._lin is None:
            parts = [torch.ops.quantized.linear_unpack_fp16(s) for s in self.shards]
            w = torch.cat([p[0] for p in parts]).half()
            bias = [p[1] for p in parts]
            b = None if bias[0] is None else torch.cat(bias)
            self._lin = qgemm.lin_dense(w, b)
        return self._lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.shards) == 1:
            return torch.ops.quantized.linear_dynamic_fp16(x, self.shards[0])
        outs = [torch.ops.quantized.linear_dynamic_fp16(x, s) for s in self.shards]
        return torch.cat(outs, dim=-1)


class Fp16Method(LinearMethod):
    name = "fp16"

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                f"quantization 'fp16' runs on the CPU in float32, not {device} {dtype}"
            )
        if not fbgemm_available():
            raise ValueError("quantization 'fp16' needs fbgemm (an x86 PyTorch build)")

    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return Fp16Linear(weight, bias)


def _int8_keeps_dense(dtype: torch.dtype) -> bool:
    """Whether an int8 layer keeps a dense copy for prompts: bf16 on AMX tiles, where
    oneDNN's bf16 GEMM over the copy runs 512 rows ~2.3x the blocks' own tiles and ~2.5x
    their int8 products (bench/qgemm.py, a 2-core AMX Xeon, 2026-12-05)."""
    return dtype == torch.bfloat16 and qgemm.amx_ready()


class GGUFLinear(nn.Module):
    """A weight as GGUF blocks for small batches, beside ``dense`` for large ones (on
    int8 rows without ``dense``, the blocks take every batch)."""

    # Up to 8 rows one expansion of each block serves every row; beyond, fbgemm's
    # fp16 GEMM is as fast or faster (decode steps of the default model, bench/qgemm.py).
    KERNEL_MAX_ROWS: ClassVar[int] = 8
    # bf16 rows on AMX tiles (kernels/amx.h) read the blocks' ~5 bits a weight where
    # torch's bf16 GEMM reads a bf16 copy: all 30 layers of the default model's linears
    # at 16 / 32 / 48 rows took 6.4 / 10.7 / 15.9 ms against 17.2 / ~19 / 21.0, level at
    # 64 (weights cold, as in a forward pass; 2-core Xeon, 2026-12-03). Against the copy
    # packed for oneDNN (onednn.py), 8.1 / 13.4 / 19.9 ms against 13.0 / 17.4 / 18.9: level
    # between 44 and 48 rows.
    AMX_MAX_ROWS: ClassVar[int] = 48

    # Rows quantized to int8 (``int8``): without AMX the kernel's int8 dot products beat
    # oneDNN's bf16 GEMM over a dense copy at every batch measured, prompts included, so
    # such a layer keeps no dense copy there (``dense`` None: the default model's ~270 MB
    # of bf16; with one, ``AMX_MAX_ROWS`` as for exact rows).
    INT8_MAX_ROWS: ClassVar[int] = 1 << 30

    def __init__(
        self,
        packed: PackedWeight,
        bias: torch.Tensor | None,
        dense: nn.Module | None,
        int8: bool = False,
    ) -> None:
        super().__init__()
        self.packed = packed
        self.lin = qgemm.lin_blocks(packed, bias)  # the bias rides in it, fp32
        self.lin.act_int8 = int(int8)
        self.int8 = int8
        self.dense = dense
        # the same weight for bf16 rows: rounding them to bf16 changes nothing, and
        # lets the kernel take its bf16 paths (dot products, AMX tiles)
        self.lin_bf16 = qgemm.Lin.from_buffer_copy(self.lin)
        self.lin_bf16.act_bf16 = 1
        self.lin_bf16.keep = self.lin.keep

    def max_rows(self, dtype: torch.dtype) -> int:
        """The most rows of ``dtype`` the block kernel takes; more go to ``dense``."""
        if self.int8 and self.dense is None:
            return self.INT8_MAX_ROWS
        amx = dtype == torch.bfloat16 and qgemm.amx_ready()
        return self.AMX_MAX_ROWS if amx else self.KERNEL_MAX_ROWS

    def _kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The block kernel's product (over x's last dimension), or None where it does
        not take ``x``."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows(x.dtype):
            return None
        lin = self.lin_bf16 if x.dtype == torch.bfloat16 else self.lin
        y = qgemm.linear(
            rows if self.dense is not None else rows.contiguous(), lin, out_dtype=out_dtype
        )
        if y is None and self.dense is None:
            raise RuntimeError(f"the int8 block kernel cannot take {x.dtype} rows on {x.device}")
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])

    def _dense(self) -> nn.Module:
        assert self.dense is not None, "_kernel takes every row of a layer without one"
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernel(x)
        return y if y is not None else self._dense()(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """As an LM head: fp32 logits, also for bf16 rows where the block kernel takes
        them. Rounded to bf16, logits near 25 lie 0.125 apart: two tokens tie where fp32
        tells them apart (the fused decode step's head is fp32 too)."""
        y = self._kernel(x, torch.float32)
        return y if y is not None else self._dense()(x).float()


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
    return layer


def _check_int8(name: str) -> None:
    if not qgemm.int8_ready():
        raise ValueError(
            f"quantization {name!r} needs the kernels' int8 dot products (AVX2 or better); "
            f"this CPU builds {native.best_isa().name!r}"
        )


class GGUFMethod(Fp16Method):
    name = "gguf"
    dtype: torch.dtype = torch.float32  # the compute dtype, set by check
    int8: ClassVar[bool] = False  # block linears quantize their rows to int8

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu" or dtype != torch.bfloat16:
            super().check(device, dtype)  # bf16 dense layers: torch's GEMM, no fbgemm
        self.dtype = dtype
        if self.int8:
            _check_int8(self.name)

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # the blocks are found in the file's exact values

    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        packed = qgemm.pack(weight)
        if packed is not None and self.int8 and not _int8_keeps_dense(self.dtype):
            return GGUFLinear(packed, bias, None, int8=True)
        if self.dtype == torch.float32:
            dense: nn.Module = super().convert(weight, bias)
        else:
            dense = _plain_linear(weight.to(self.dtype), bias)
        return dense if packed is None else GGUFLinear(packed, bias, dense, self.int8)


class GGUFA8Method(GGUFMethod):
    name = "gguf_a8"
    int8 = True


class BlockQuantMethod(LinearMethod):
    """Any checkpoint's linear weights rounded to GGUF blocks as they load, bit for bit
    as llama.cpp's quantizer rounds them (``qgemm.quantize``), then run as the ``gguf``
    method runs a GGUF's blocks; prompts take a dense copy of the rounded weights, so
    both paths compute with the same values. A weight whose rows are not whole blocks
    stays as it is."""

    kind: ClassVar[str] = ""  # "q8_0" or "q4_1"
    dtype: torch.dtype = torch.float32  # the compute dtype, set by check
    int8: ClassVar[bool] = False  # block linears quantize their rows to int8

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"quantization {self.name!r} runs on the CPU in float32 or bfloat16, "
                f"not {device} {dtype}"
            )
        if self.int8:
            _check_int8(self.name)
        self.dtype = dtype

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # rounded from the checkpoint's exact values

    def convert(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        # the dense copy prompts read (where one is kept), written in the compute dtype
        # as the blocks round
        keep = not self.int8 or _int8_keeps_dense(self.dtype)
        rounded = torch.empty(weight.shape, dtype=self.dtype) if keep else None
        packed = qgemm.quantize(weight, self.kind, rounded)
        if packed is None:
            return _plain_linear(weight.to(self.dtype), bias)
        if rounded is None:
            return GGUFLinear(packed, bias, None, int8=True)
        return GGUFLinear(packed, bias, _plain_linear(rounded, bias), self.int8)


class Q8_0Method(BlockQuantMethod):
    name = "q8_0"
    kind = "q8_0"


class Q4_1Method(BlockQuantMethod):
    name = "q4_1"
    kind = "q4_1"


class Q8_0A8Method(Q8_0Method):
    name = "q8_0_a8"
    int8 = True


class Q4_1A8Method(Q4_1Method):
    name = "q4_1_a8"
    int8 = True


def native_lin(module: nn.Module) -> qgemm.Lin | None:
    """The weight of a linear layer, as a linear method left it, for the native kernels
    (``qgemm.linear``, ``kernels.step``), or None for a module they cannot read."""
    if isinstance(module, GGUFLinear):
        return module.lin
    if isinstance(module, Fp16Linear):
        return module.lin()
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return qgemm.lin_dense(module.weight, module.bias)  # MergedLinear too
    return None


def quantize_model(model: nn.Module, method: LinearMethod) -> int:
    """Replace every ``nn.Linear`` of ``model`` (and its LM head, through
    ``set_lm_head`` when the model has one) with ``method``'s module; returns the count."""
    if isinstance(method, NoQuantization):
        return 0
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, method.convert(module.weight.data, _bias(module)))
    count = len(linears)
    lm: Any = model  # a CausalLM: its tied head is converted through set_lm_head
    if getattr(lm, "tied", False) and hasattr(lm, "set_lm_head"):
        lm.set_lm_head(method.convert(lm.lm_head_weight(), None))
        count += 1
    return count


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.data


QUANTIZATION_METHODS.register_builtin("none", NoQuantization, help="full precision")
QUANTIZATION_METHODS.register_builtin(
    "fp16", Fp16Method, help="fp16 weights, fp32 compute (fbgemm, CPU)"
)
QUANTIZATION_METHODS.register_builtin(
    "gguf",
    GGUFMethod,
    help="a GGUF's Q4_1/Q8_0 blocks, exact, for decode; fp16 (float32) or bf16 GEMMs for prefill (CPU)",
)
QUANTIZATION_METHODS.register_builtin(
    "gguf_a8",
    GGUFA8Method,
    help="as gguf, the blocks' rows quantized to int8 per 32 (llama.cpp's CPU arithmetic; "
    "AVX2 or AVX512-VNNI: faster, not exact)",
)
QUANTIZATION_METHODS.register_builtin(
    "q8_0", Q8_0Method, help="any checkpoint's weights rounded to Q8_0 blocks as they load (CPU)"
)
QUANTIZATION_METHODS.register_builtin(
    "q4_1", Q4_1Method, help="any checkpoint's weights rounded to Q4_1 blocks as they load (CPU)"
)
QUANTIZATION_METHODS.register_builtin(
    "q8_0_a8", Q8_0A8Method, help="as q8_0, the rows quantized to int8 per 32 (as gguf_a8)"
)
QUANTIZATION_METHODS.register_builtin(
    "q4_1_a8", Q4_1A8Method, help="as q4_1, the rows quantized to int8 per 32 (as gguf_a8)"
)
