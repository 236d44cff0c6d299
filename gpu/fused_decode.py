"""Decode steps as one native call (``kernels/step.py`` over ``cpu_step.c``), for any
model that describes itself as a Llama-shaped decoder.

A decode step at batch 1-8 through the model's Python is ~300 small kernel calls,
each a dispatch and a thread fork/join; they cost more than the weights take to
read. ``FusedDecoder`` reads the model's weights once, as descriptors of what its
linear method left (GGUF blocks, fp16/bf16/fp32 rows), and then serves every step
whose new tokens fit its rows (decodes; short prompts and short extensions of a cached
prefix, one row a token) from the step's token ids, positions and page tables alone:
the model's Python runs once, as a CUDA graph is captured once. On AMX tiles, where
one call takes a whole prompt chunk, a larger step runs as several calls (``split``);
elsewhere other steps (longer prompts, larger batches) take the model's forward.

A model family opts in with ``register_spec(ModelClass, fn)``: ``fn(model)`` returns
its ``StepWeights`` (kernels/step.py), or None when this instance cannot be fused
(another layer shape, a linear method the kernels cannot read). Only the exact class
registered is fused: a subclass that changes the layer math is never taken for its
parent. Qwen3 registers the Llama spec, which reads its per-head q and k norms (the
step norms each head before RoPE); Gemma 2 and 3 register their own (``gemma_spec``:
scaled embeddings, output norms, tanh-GELU, two RoPE tables, soft caps). Layers with a
sliding window attend within it. Qwen3-MoE and Mixtral register the Llama spec too:
their ``SparseMoE`` layers become ``MoEWeights`` (the router and each expert's two
linears), routed and run inside the step.

With LoRA (``attach_lora``), steps whose rows use adapters stay fused too: the step
reads the worker's adapter slots in place (``kernels/lora.py``'s descriptors) and adds
each row's deltas where its projections are made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import nn

from .attention.base import AttentionBackend
from .attention.cpu import CpuBackend
from .attention.torch_native import TorchNativeBackend
from .forward_meta import SeqSpec
from .kernels.attention import prefill_tiles
from .kernels.qgemm import AMX_TILES_MIN_ROWS, BLOCK_KINDS
from .kernels.step import Cascade, DecodeStep, LayerWeights, MoEWeights, StepWeights, native_step
from .kv_pool import KVPool
from .models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    GemmaDecoderLayer,
)
from .models.layers import Attention, GatedMLP, GemmaRMSNorm, RMSNorm
from .models.llama import DecoderLayer, LlamaForCausalLM
from .models.mixtral import MixtralForCausalLM
from .models.moe import SparseMoE
from .models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from .quantization import native_lin

if TYPE_CHECKING:
    from .lora.plan import LoraPlan
    from .lora.pool import LoraMemoryPool

__all__ = ["FusedDecoder", "ThreadChooser", "llama_spec", "register_spec"]

log = logging.getLogger(__name__)

_SPECS: dict[type, Callable[[Any], StepWeights | None]] = {}

# the kernel builds whose fused step attends a sequence's rows on bf16 products (flash.h)
_BF16_LEVELS = frozenset({"avx512bf16", "amx"})


def register_spec(model_cls: type, fn: Callable[[Any], StepWeights | None]) -> None:
    """Let ``model_cls`` (exactly) decode through the fused step, described by ``fn``."""
    _SPECS[model_cls] = fn


def _moe(moe: SparseMoE) -> MoEWeights | None:
    """A sparse MoE's router and experts as step weights (its shared expert's gate; the
    expert itself is the layer's dense MLP), or None."""
    moe.dense_experts()  # plain experts stacked now, as the forward would on first use
    experts = []
    mlps: list[GatedMLP] = list(moe.experts)  # type: ignore[arg-type]
    for mlp in mlps:
        gate_up, down = native_lin(mlp.gate_up_proj), native_lin(mlp.down_proj)
        if gate_up is None or down is None:
            return None
        experts.append((gate_up, down))
    gate = None if moe.shared_expert is None else moe.shared_expert_gate.weight.data[0]
    return MoEWeights(moe.gate.weight.data, experts, moe.top_k, moe.renormalize, gate)


def _layer(
    attn: Attention,
    mlp: GatedMLP | SparseMoE,
    norms: tuple[RMSNorm, ...],
    eps: float,
    window: int,
    rope: int,
) -> LayerWeights | None:
    """A layer as step weights: its linears as kernel descriptors (a sparse MoE's
    experts in place of the dense MLP's two), ``norms`` (before attention, before the
    MLP, and Gemma's of their outputs) and its q and k norms, all of the class of
    ``norms[0]`` and of ``eps``, its window and RoPE table; or None."""
    qk = [n for n in (attn.q_norm, attn.k_norm) if n is not None]  # StepWeights checks both
    if any(type(n) is not type(norms[0]) or n.eps != eps for n in (*norms, *qk)):
        return None
    qkv, o = native_lin(attn.qkv_proj), native_lin(attn.o_proj)
    if qkv is None or o is None:
        return None
    q_norm, k_norm = (n.weight if n is not None else None for n in (attn.q_norm, attn.k_norm))
    moe, dense = (_moe(mlp), mlp.shared_expert) if isinstance(mlp, SparseMoE) else (None, mlp)
    if isinstance(mlp, SparseMoE) and moe is None:
        return None
    gate_up = down = None  # the dense MLP's, or a MoE's shared expert's
    if dense is not None:
        gate_up, down = native_lin(dense.gate_up_proj), native_lin(dense.down_proj)
        if gate_up is None or down is None:
            return None
    made = LayerWeights(qkv, o, gate_up, down, norms[0].weight, norms[1].weight, q_norm, k_norm)
    made.moe = moe
    if len(norms) == 4:
        made.attn_out_norm, made.ffn_out_norm = norms[2].weight, norms[3].weight
    made.window, made.rope = window, rope
    return made


def _head(model: Any) -> Any:
    """The LM head's kernel descriptor, or None."""
    if model.head is not None:
        head_module: nn.Module | None = model.head
    elif not model.tied:
        head_module = model.lm_head
    else:
        head_module = None
    if head_module is not None:
        return native_lin(head_module)
    from .kernels.qgemm import lin_dense

    return lin_dense(model.lm_head_weight())


def _weights(model: Any, layers: list[LayerWeights], norm: type[RMSNorm]) -> StepWeights | None:
    """``layers`` with the model's embeddings, final norm (of class ``norm``) and head."""
    head, info, final = _head(model), model.info, model.model.norm
    if head is None or type(final) is not norm:
        return None
    return StepWeights(
        embed=model.model.embed_tokens.weight.data,
        layers=layers,
        final_norm=final.weight,
        head=head,
        eps=info.rms_norm_eps,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
    )


def llama_spec(model: LlamaForCausalLM) -> StepWeights | None:
    """The Llama family's layers (Mistral, Qwen2 with its qkv bias, SmolLM2, Phi-3 and
    Phi-4-mini's partial rotary, their sliding windows; Qwen3 with its q and k norms;
    Qwen3-MoE and Mixtral with their experts) as step weights."""
    info = model.info
    if len(model.ropes) != 1 or info.final_logit_softcapping or model.attention_softcap:
        return None  # one RoPE table, uncapped scores and logits
    if abs(model.attention_scale - info.head_dim**-0.5) > 1e-12:
        return None
    layers = []
    layer: Any
    rotary = int(info.head_dim * info.partial_rotary_factor)  # a share of a head: Phi-4-mini
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer), type(attn)) != (DecoderLayer, Attention) or type(mlp) not in (
            GatedMLP,
            SparseMoE,
        ):
            return None
        if attn.rotary_dim != rotary or mlp.act != "silu":
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if type(norms[0]) is not RMSNorm:
            return None
        made = _layer(attn, mlp, norms, info.rms_norm_eps, model.layer_windows[i], 0)
        if made is None:
            return None
        layers.append(made)
    weights = _weights(model, layers, RMSNorm)
    if weights is not None:
        weights.rotary_dim = rotary
    return weights


for _llama in (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM):
    register_spec(_llama, llama_spec)


def gemma_spec(model: Gemma2ForCausalLM) -> StepWeights | None:
    """Gemma 2 and Gemma 3 (text) as step weights: the Llama layer with its embeddings
    scaled, the attention's and the MLP's outputs normed (the norms' 1 + weight folded
    in as loaded), tanh-GELU, per-layer windows and RoPE tables (Gemma 3's windowed
    layers' own base), soft-capped scores and logits (Gemma 2)."""
    info = model.info
    if len(model.ropes) > 2:
        return None
    layers = []
    layer: Any
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if (type(layer), type(attn), type(layer.mlp)) != (GemmaDecoderLayer, Attention, GatedMLP):
            return None
        if attn.rotary_dim != info.head_dim or layer.mlp.act != "gelu_pytorch_tanh":
            return None
        norms = (
            layer.input_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_attention_layernorm,
            layer.post_feedforward_layernorm,
        )
        if type(norms[0]) is not GemmaRMSNorm:
            return None
        made = _layer(
            attn, layer.mlp, norms, info.rms_norm_eps, model.layer_windows[i], model.rope_of(i)
        )
        if made is None:
            return None
        layers.append(made)
    weights = _weights(model, layers, GemmaRMSNorm)
    if weights is not None:
        weights.ropes = len(model.ropes)
        # the scale rounded to the embeddings' dtype, as the model's forward takes it
        weights.embed_scale = float(torch.tensor(model.embed_scale, dtype=weights.embed.dtype))
        weights.softcap = model.attention_softcap
        weights.final_softcap = float(info.final_logit_softcapping or 0.0)
        weights.act = "gelu_tanh"
    return weights


for _gemma in (Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration):
    register_spec(_gemma, gemma_spec)


class _RopeSteps(NamedTuple):
    """What ``Rope.cos_sin`` reads of a step's ForwardMeta."""

    positions: torch.Tensor
    max_seq_len: int
    seq_lens: list[int]
    extend_lens: list[int]


class ThreadChooser:
    """The team size for each size of step, by measured step time: all of torch's
    threads, or half of them. A thread team is only as fast as its slowest member, and
    on a machine shared with other busy processes one of the team often waits for a
    core (seen on the 2-core VM: batch-1 steps took 10 ms on one thread, 33 ms on two,
    while other jobs ran; 4-5 ms and ~3 ms when it was quiet).

    Steps are told apart by their rows: each count up to ``EXACT`` (decode batches: a
    serving level keeps to a few), then by the power of two above it (a prompt's chunks
    of 300 and of 500 rows are one size), and timed per row. Every ``EXPLORE``-th step
    of a size may try the team it is not using (a look), when:

    - the team in use is not the whole team (the load may have gone);
    - the team in use runs ``SLOWED`` slower a row than its best (load came);
    - the other team is untried, and the size is one of decode batches (a look costs a
      step about twice its time: a few ms there, a 470-token prompt 160 against 80 ms on
      a 2-core AMX Xeon), or another size runs on the other team now (load is here).

    A look that finds the other team ``CLEARLY`` slower doubles the interval to the next,
    up to ``EXPLORE_MAX``. A quiet machine so pays one look a decode batch size and none
    a prompt's. Keyed by exact row counts and trying the other team at each one's second
    step, prompts paid a look each time a chunk's length came back (a third of a warm
    shared-prefix level's steps ran on one thread). The results are the same bits
    either way.
    """

    EXACT = 64
    EXPLORE = 16
    EXPLORE_MAX = 128
    CLEARLY = 1.25  # a look's team slower than the other by this factor
    SLOWED = 1.5  # the team in use slower than its best by this factor: a team of
    # threads sharing cores with busy processes runs ~2-3x slower; steps' own spread
    # (their contexts, the last-level cache after a prompt) mostly stays under it
    DECAY = 0.5  # of the moving average of step times: a few looks follow a change

    def __init__(self) -> None:
        self._ema: dict[tuple[int, int], float] = {}  # seconds a row, by (size, team)
        self._best: dict[tuple[int, int], float] = {}  # the lowest that average reached
        self._uses: dict[int, int] = {}  # the team each size runs on
        self._every: dict[int, int] = {}  # steps between looks, by size
        self._until: dict[int, int] = {}  # steps to the next look
        self._looking: dict[int, int] = {}  # the team a look is trying

    def options(self) -> list[int]:
        threads = torch.get_num_threads()
        return sorted({threads, max(1, threads // 2)}, reverse=True)

    @classmethod
    def size(cls, rows: int) -> int:
        return rows if rows <= cls.EXACT else 1 << (rows - 1).bit_length()

    def pick(self, rows: int) -> int:
        options, size = self.options(), self.size(rows)
        team = self._uses.get(size, options[0])
        if team not in options:  # torch's threads changed
            team = self._uses[size] = options[0]
        left = self._until.get(size, self.EXPLORE) - 1
        if left > 0 or len(options) == 1:
            self._until[size] = left
            return team
        self._until[size] = self._every.get(size, self.EXPLORE)
        other = next(t for t in options if t != team)
        if not self._look(size, team, other, options[0]):
            return team
        self._looking[size] = other
        return other

    def _look(self, size: int, team: int, other: int, whole: int) -> bool:
        if team != whole:
            return True
        ema = self._ema.get((size, team))
        if ema is not None and ema > self.SLOWED * self._best[size, team]:
            return True
        if (size, other) in self._ema:
            return False
        return size <= self.EXACT or any(t != whole for t in self._uses.values())

    def record(self, rows: int, threads: int, seconds: float) -> None:
        size, per_row = self.size(rows), seconds / max(rows, 1)
        look = self._looking.pop(size, None) == threads
        old = None if look else self._ema.get((size, threads))  # a look: the load now
        ema = per_row if old is None else self.DECAY * old + (1 - self.DECAY) * per_row
        self._ema[size, threads] = ema
        self._best[size, threads] = min(ema, self._best.get((size, threads), ema))
        if not look:
            return
        team = self._uses.get(size, max(self.options()))
        slower = (size, team) in self._ema and ema > self.CLEARLY * self._ema[size, team]
        every = self._every.get(size, self.EXPLORE)
        every = min(2 * every, self.EXPLORE_MAX) if slower else self.EXPLORE
        self._every[size] = self._until[size] = every
        if ema < self._ema.get((size, team), float("inf")):
            self._uses[size] = threads


class FusedDecoder:
    """Serves steps of up to ``max_batch`` rows in one native call: decodes, and short
    prompts and extensions of a cached prefix (``max_new`` tokens), a row a token."""

    # A sequence's new tokens the step takes, a row each; its rows (8 or more) attend
    # together as prompts do, K and V read once a block of rows. Over a bf16 pool on a
    # CPU with AVX512-BF16 on bf16 products (flash.h), and with AMX tiles the linears'
    # tiles also sum over whole weights from 41 rows (amx.h); elsewhere in fp32
    # (flash_f32.h), where past 32 rows the linears cost more than the model's forward
    # (its GEMMs), unless every linear quantizes its rows to int8: the forward runs those
    # on the step's own kernels (dpi8.h), and the step is ahead at any size. Default
    # model, 2-core Ice Lake (VNNI, no bf16), fp32, over 1,104 cached tokens: gguf_a8 32
    # / 128 / 512 tokens 48.7 / 182 / 824 against 65.8 / 218 / 889 ms, 64 decodes 124
    # against 161, 127 decodes 314 against 335; gguf 32 / 64 / 128 tokens 97 / 185 / 309
    # against 119 / 194 / 293; dense fp32 32 / 64 113.6 / 199 against 203 / 164. (Rows
    # attended a row at a time, 16 gguf_a8 tokens cost 53 ms, now 22.) Default model,
    # bf16, over 1,104 cached tokens (bench/extend.py), fused step against the model:
    # 2-core Xeon, tiles: 32 tokens 17.2 against 24.2 ms, 64 tokens 26.0 against 37.2,
    # 128 tokens 41.7 against 51.9, 192 tokens 62.1 against 66.3, 256 tokens 82.2 against
    # 79.0; a row each: 16 tokens 15.9 against 18.1, 32 tokens 28.3 against 28.9. 2-core
    # Zen 4, dot products: 16 tokens 20.1 against 29.5, 32 tokens 33.0 against 43.9; with
    # Q4_1 layers, their codes expanded in registers (dpbf16.h), 48 tokens 53.6 against
    # 60.1, 64 tokens 64.1 against 71.5, 96 tokens 95.5 against 104.1. Later kernels moved
    # the tiles' end (2-core Xeon, 2026-12-05): over 1,104 cached tokens 192 tokens 54.5
    # against 67.3 ms, 256 69.9 against 78.6, 320 95.3 against 99.1; fresh prompts of 192
    # / 256 / 320 tokens 40.2 / 52.8 / 67.9 against 49.1 / 59.8 / 75.2; once the team
    # shared the residual rows of such steps (cpu_step.c), 384 / 448 / 512 tokens 66.4 /
    # 78.8 / 82.5 against 82.3 / 88.5 / 99.5, 512 over 512 / 1,024 cached 111.9 / 143.1
    # against 123.8 / 148.0: up to the AMX platform's prefill budget a step.
    MAX_NEW: ClassVar[int] = 512  # rows of one sequence on tiles, or on int8 rows
    MAX_NEW_DOTS: ClassVar[int] = 32  # on AVX512-BF16's dot products
    MAX_NEW_DOTS_Q4: ClassVar[int] = 64  # there, over Q4_1 layers
    MAX_NEW_FP32: ClassVar[int] = 32
    # Rows a step by default (``fused_decode_max_batch`` -1): on tiles as above, decodes
    # of 48 / 64 / 128 sequences ran 1.34 / 1.33 / 1.18x the model's forward (level at
    # 192-256; dense bf16 weights, ``--quantization none``: 1.28 / 1.20 / 0.96x); on the
    # dot products over Q4_1 layers (2-core Zen 4) 48 / 64 sequences 1.17 / 1.08x, 96 /
    # 128 0.98 / 0.89x (over dense bf16 weights, which take fp32 tiles there, 48 / 64
    # sequences 0.75 / 0.83x); elsewhere the fp32 tiles' cost grows with every row, and 32.
    # On tiles (2026-12-05): 160 decodes 78.4 against 88.6 ms, 256 level; a prompt of
    # 192 / 200 / 240 / 256 / 300 tokens beside 64 / 32 / 8 / 64 / 8 decodes 84.1 / 66.0 /
    # 59.2 / 99.9 / 75.3 against 95.0 / 75.5 / 64.4 / 109.6 / 80.5; with the residual
    # rows shared, 360 decodes 231.0 against 258.3, two prompts of 250 / 240 beside 8 / 32
    # decodes 87.4 / 106.2 against 102.4 / 115.0, 512 tokens beside 128 decodes 184.0
    # against 205.5: the prefill budget beside as many decodes as a step has at c=128.
    # Where every linear takes int8 rows, as many (2-core Ice Lake: above).
    MAX_BATCH_TILES: ClassVar[int] = 640
    # A bf16 model's layers keep their weights as AMX's tiles too (2 bytes a weight; the
    # default model's 30 layers 202 MiB; left out where they would take over half the
    # memory available, kernels/step.py), so that steps of 41 rows or more load them as
    # they lie rather than expanding GGUF blocks or transposing bf16 rows every step, and
    # block them for L1 and L2 as a GEMM does (kernels/amx.h): with the SiLU epilogue
    # and the bf16 rows that come with them (cpu_step.c), a 512-token prompt ~86 -> ~74
    # ms (alternated three times), 64 decodes ~1.1x (2-core AMX Xeon, 2026-12-05)
    AMX_TILES: ClassVar[bool] = True
    # Steps of AMX_TILES_MIN_ROWS to COLD_TILES_FROM - 1 rows read those tiles only where
    # they are likely in the last-level cache: after a step that read them, or from the
    # WARM_RUN-th of a run of such steps (decodes of 48 sequences back to back). Alone,
    # as a warm request's new tokens after decodes of a few rows (which read the codes),
    # they find the tiles evicted and read them from memory, 2 bytes a weight where the
    # codes are ~0.56: those steps expand the codes instead, to the same bits.
    COLD_TILES_FROM: ClassVar[int] = 129
    WARM_RUN: ClassVar[int] = 3
    MAX_BATCH_DOTS_Q4: ClassVar[int] = 64
    MAX_BATCH: ClassVar[int] = 32

    def __init__(
        self, model: Any, step: DecodeStep, page_size: int, max_batch: int, level: str
    ) -> None:
        self.model = model
        self.step = step
        self.page_size = page_size
        self.isa = level
        tiles = step.kv_bf16 and step.weights.head_dim % 64 == 0 and prefill_tiles(level)
        dots = step.kv_bf16 and step.weights.head_dim % 32 == 0 and level in _BF16_LEVELS
        lins = [w for x in step.weights.layers for w in x.lins()]
        q4 = dots and all(w.kind == BLOCK_KINDS["q4_1"] for w in lins)  # dpbf16.h's dp_q4_pass
        # every linear on int8 rows: the forward runs them on the step's own kernels at
        # any row count (but on AMX, whose tiles take bf16 rows from 9: `tiles` there).
        # Over a bf16 pool on AVX512-BF16 (2-core Zen 4, 2026-12-07) prompts of 256 / 512
        # tokens 134 / 289 ms against the forward's 154 / 317, 250 beside 16 decodes 149
        # against 170, decodes of 96 / 128 sequences 1,100 / 1,106 tok/s against 943 / 979
        int8 = level != "amx" and all(w.act_int8 for w in lins)
        if tiles or int8:
            self.max_new = self.MAX_NEW
        elif dots:
            self.max_new = self.MAX_NEW_DOTS_Q4 if q4 else self.MAX_NEW_DOTS
        else:
            self.max_new = self.MAX_NEW_FP32
        if max_batch < 0:
            max_batch = (
                self.MAX_BATCH_TILES
                if tiles or int8
                else self.MAX_BATCH_DOTS_Q4
                if q4
                else self.MAX_BATCH
            )
        self.max_batch = max_batch
        self.threads = ThreadChooser()
        self._run = 0  # steps of AMX_TILES_MIN_ROWS rows or more in a row, up to this one
        self._tiles_read = False  # the last step read the tiles
        # decodes whose contexts begin in the same pages read them once a chunk of rows
        # (kernels/step.py's Cascade; not within windows); False: once a row, as the
        # model's forward does
        self.cascade = not step.weights.windowed
        self._chunk_rows = Cascade.sequences(step.weights.num_heads, step.weights.num_kv_heads)

    @classmethod
    def build(
        cls, model: Any, backend: AttentionBackend, max_batch: int, level: str = ""
    ) -> tuple[FusedDecoder | None, str]:
        """The decoder over ``backend``'s pool, or None and the reason it cannot serve
        this model here. Only the built-in backends: the step attends as they do, and a
        plugin's backend must see every step it was chosen for."""
        if max_batch == 0:
            return None, "turned off"
        if type(backend) not in (CpuBackend, TorchNativeBackend):
            return None, f"attention backend {type(backend).__name__}"
        pool, scale = backend.pool, backend.scale
        spec = _SPECS.get(type(model))
        if spec is None:
            return None, f"{type(model).__name__} registers no fused step"
        if type(pool) is not KVPool or pool.device.type != "cpu":
            return None, f"{type(pool).__name__} on {pool.device}"
        if native_step(level) is None:
            return None, "no C compiler"
        weights = spec(model)
        if weights is None:
            return None, "this model's layers or linear method"
        if why := weights.check():
            return None, why
        step = DecodeStep(weights, pool.kv, pool.page_size, scale, level, cls.AMX_TILES)
        from .kernels import native

        return cls(model, step, pool.page_size, max_batch, level or native.best_isa().name), ""

    def tiles_words(self) -> str:
        """The memory its layers' AMX tiles take, for the start-up log ("" without)."""
        mib = sum(t.nbytes for t in self.step.tiles) / 2**20
        return f", its weights also as AMX tiles ({mib:.0f} MiB)" if mib else ""

    def weight_ptrs(self) -> set[int]:
        """Where the step's weights live (``data_ptr``): tensors it reads in their plain
        layout, which must stay as they are (``onednn.pack_linears`` leaves them)."""
        w = self.step.weights
        lins = [w.head, *(lin for layer in w.layers for lin in layer.lins())]
        return {t.data_ptr() for lin in lins for t in getattr(lin, "keep", ())}

    def attach_lora(self, pool: LoraMemoryPool) -> bool:
        """Read ``pool``'s adapter slots in later steps; False where the kernel cannot
        (then steps with adapters take the model's forward)."""
        from .lora.targets import LORA_MODULES

        if not pool.native or any(x.moe for x in self.step.weights.layers):
            return False  # adapters on experts: the model's forward
        layers = len(self.step.weights.layers)
        descs = [pool.desc(m, layer) for layer in range(layers) for m in LORA_MODULES]
        if any(d is None for d in descs) or pool.shapes.num_layers != layers:
            return False
        self.step.set_lora(descs, pool.max_rank)  # type: ignore[arg-type]
        return True

    @property
    def splits(self) -> bool:
        """Whether steps too large for one call run as several (``split``): where it
        takes whole prompt chunks (AMX tiles) in calls at least that large."""
        return self.max_new >= self.MAX_NEW and self.max_batch >= self.max_new

    def split(
        self, seqs: Sequence[SeqSpec], plan: LoraPlan | None = None
    ) -> list[list[tuple[int, SeqSpec]]] | None:
        """A step too large for one call as calls this decoder takes, to run in order
        (``run_split``), or None: it fits one call, it has adapters, or this decoder takes
        prompts a few rows at a time (there the model's forward serves long ones as well).
        A sequence's new tokens go in chunks of up to ``max_new``, each chunk in a later
        call than the one before it (its keys are in the pool by then), and only the last
        one samples; a chunk joins the first call from there with room for its rows. Each
        entry: the sequence's index in ``seqs`` and its chunk.

        The prefill budget is the platform's (``--max-prefill-tokens``: 1,024 and more on
        AMX CPUs of 4 cores and more) and may pass what one call takes; split, such a step
        keeps the fused step's speed. The default model's prompts on the 2-core AMX Xeon,
        in calls of 512 against the model's forward whole: 1,024 tokens 181 against 225 ms,
        2,048 430 against 503."""
        if plan is not None or not self.splits:
            return None
        if not seqs or not all(s.input_ids for s in seqs) or self.accepts(seqs):
            return None
        calls: list[list[tuple[int, SeqSpec]]] = []
        rows: list[int] = []
        for i, s in enumerate(seqs):
            n, after = len(s.input_ids), 0  # after: the first call its next chunk may join
            for c0 in range(0, n, self.max_new):
                ids = s.input_ids[c0 : c0 + self.max_new]
                last = c0 + len(ids) == n
                k = after
                while k < len(calls) and rows[k] + len(ids) > self.max_batch:
                    k += 1
                if k == len(calls):
                    calls.append([])
                    rows.append(0)
                chunk = SeqSpec(ids, s.start_pos + c0, s.page_ids, s.sample and last, s.prompt_len)
                calls[k].append((i, chunk))
                rows[k] += len(ids)
                after = k + 1
        return calls

    def run_split(
        self,
        calls: list[list[tuple[int, SeqSpec]]],
        on_argmax: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """``run`` over ``split``'s calls in turn: the logits [S, vocab] of the sequences
        that sample, in the step's order, and ``on_argmax`` called once with them all."""
        logits: list[torch.Tensor] = []
        picks: list[torch.Tensor] = []
        owners: list[int] = []

        def keep(_: torch.Tensor, p: torch.Tensor) -> None:
            picks.append(p)

        for call in calls:
            logits.append(self.run([s for _, s in call], None, None if on_argmax is None else keep))
            owners += [i for i, s in call if s.sample]
        order = torch.from_numpy(np.argsort(np.asarray(owners, np.int64), kind="stable"))
        out = torch.cat(logits)[order]
        if on_argmax is not None:
            on_argmax(out, torch.cat(picks)[order])
        return out

    def accepts(self, seqs: Sequence[SeqSpec], plan: LoraPlan | None = None) -> bool:
        """Whether the step is this decoder's: its sequences' new tokens (one a decode;
        up to ``max_new`` for a short prompt, a chunk of a longer one, or the tokens over
        a cached prefix) are at most ``max_batch`` rows, and its adapters (``plan``) are
        in slots the step reads, for decodes alone."""
        news = [len(s.input_ids) for s in seqs]
        rows = sum(news)
        if plan is not None and (plan.rows is None or not self.step.has_lora or rows > len(seqs)):
            return False
        return 0 < rows <= self.max_batch and max(news) <= self.max_new

    def run(
        self,
        seqs: Sequence[SeqSpec],
        plan: LoraPlan | None = None,
        on_argmax: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] fp32 of the last new token of each sequence that samples
        (each with its adapter, by ``plan``): one row a token, each attending to the keys
        up to its own; K and V go to the pool. A chunk of a prompt that is not its last
        samples nothing: its logits are computed with the others' (the head reads its
        weights once for all rows) and left out. ``on_argmax``: called with the logits
        and each row's argmax, which the step finds as it makes them."""
        ps = self.page_size
        news = np.fromiter((len(s.input_ids) for s in seqs), np.int64, len(seqs))
        B = int(news.sum())
        extends = len(seqs) < B  # some sequence has several new tokens
        if extends:
            tokens = np.fromiter((t for s in seqs for t in s.input_ids), np.int64, B)
            pos = np.concatenate([s.start_pos + np.arange(len(s.input_ids)) for s in seqs])
            owner = np.repeat(np.arange(len(seqs)), news)  # each row's sequence
        else:
            tokens = np.fromiter((s.input_ids[0] for s in seqs), np.int64, B)
            pos = np.fromiter((s.start_pos for s in seqs), np.int64, B)
            owner = np.arange(B)
        lens = pos + 1
        width = int(-(-lens.max() // ps))
        tables = np.zeros((len(seqs), width), np.int64)
        for i, s in enumerate(seqs):
            n = -(-(s.start_pos + len(s.input_ids)) // ps)
            tables[i, :n] = s.page_ids[:n]
        pages = tables[owner] if extends else tables
        slots = pages[np.arange(B), pos // ps] * ps + pos % ps
        # as the model's forward would read RoPE: each sequence's length, the whole
        # prompt's while chunked (LongRoPE picks its factors by it)
        ends = [s.start_pos + len(s.input_ids) for s in seqs]
        seq_lens = [max(e, s.prompt_len) for e, s in zip(ends, seqs, strict=True)]
        row_lens = [seq_lens[i] for i in owner.tolist()] if extends else seq_lens
        steps = _RopeSteps(torch.from_numpy(pos), max(ends), row_lens, [1] * B)
        rots = [rope.cos_sin(steps) for rope in self.model.ropes[: self.step.weights.ropes]]
        half = rots[0][0].shape[-1]
        cos = torch.stack([c.reshape(B, half) for c, _ in rots]).to(torch.float32).contiguous()
        sin = torch.stack([s.reshape(B, half) for _, s in rots]).to(torch.float32).contiguous()
        threads = self.threads.pick(B)
        if self.step.tiles:
            self.step.tiles_from = self._tiles_from(B)
        t0 = time.perf_counter()
        rows = None if plan is None else plan.rows
        last = np.cumsum(news) - 1 if extends else None
        cascade = None
        if self.cascade and not extends:
            cascade = Cascade.find(pages, lens, ps, self._chunk_rows)
        picks = None if on_argmax is None else torch.empty(len(seqs), dtype=torch.int64)
        logits = self.step(
            tokens, cos, sin, slots, pages, lens, threads, rows, last, cascade, picks
        )
        self.threads.record(B, threads, time.perf_counter() - t0)
        if not all(s.sample for s in seqs):
            keep = [i for i, s in enumerate(seqs) if s.sample]
            logits = logits[keep]
            picks = None if picks is None else picks[keep]
        if on_argmax is not None and picks is not None:
            on_argmax(logits, picks)
        return logits

    def _tiles_from(self, rows: int) -> int:
        """The rows from which a step of ``rows`` reads the layers' tiles (see
        COLD_TILES_FROM), noting whether it does."""
        self._run = self._run + 1 if rows >= AMX_TILES_MIN_ROWS else 0
        warm = self._tiles_read or self._run >= self.WARM_RUN
        start = AMX_TILES_MIN_ROWS if warm else self.COLD_TILES_FROM
        self._tiles_read = rows >= start
        return start
