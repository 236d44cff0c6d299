"""The binding of ``cpu_step.c``: a whole decode step of a Llama-shaped model in one
native call, and the bf16-pool decode attention the ``cpu`` backend uses.

``DecodeStep`` takes the model as plain data (``StepWeights``: each linear a ``Lin``
descriptor, norms as fp32 vectors) once, and then runs steps from the step's inputs
alone: token ids, positions' cos/sin, KV slots, page tables and lengths. The model's
Python never runs for such a step, as a CUDA graph replays a captured decode on a GPU
(``gpu/fused_decode.py`` builds it from a model and decides which steps it serves).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import native
from .arena import Arena
from .lora import LoraDesc
from .qgemm import QK, Lin, amx_ready, amx_tiles

__all__ = ["Cascade", "DecodeStep", "LayerWeights", "MoEWeights", "StepWeights", "native_step"]

log = logging.getLogger(__name__)

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Lin),
        ("o", Lin),
        ("gate_up", Lin),
        ("down", Lin),
        ("in_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("attn_out_norm", _P),
        ("ffn_out_norm", _P),
        ("window", _I),
        ("rope", _I),
        ("router", _P),
        ("experts", ctypes.POINTER(Lin)),
        ("num_experts", _I),
        ("top_k", _I),
        ("moe_inter", _I),
        ("renorm", _I),
        ("route_bf16", _I),
        ("shared_gate", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
        ("vocab", _I),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(_Layer)),
        ("embed", _P),
        ("embed_bf16", _I),
        ("final_norm", _P),
        ("head", Lin),
        ("kv", _P),
        ("kv_bf16", _I),
        ("num_pages", _I),
        ("page_size", _I),
        ("lora", ctypes.POINTER(LoraDesc)),
        ("lora_rank", _I),
        ("rot_half", _I),
        ("embed_scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("final_softcap", ctypes.c_double),
        ("act_gelu", _I),
        ("split_keys", _I),
        ("tiles_from", _I),
    ]


@cache
def native_step(level: str = "") -> Any | None:
    """The compiled kernels for ISA ``level`` (default: the best here), or None."""
    lib = native.load(Path(__file__).with_name("cpu_step.c"), level)
    if lib is None:
        return None
    step = lib.actorlm_decode_step
    step.argtypes = [ctypes.POINTER(_Model), _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _P, _P, _I, _P, _T]  # fmt: skip
    step.restype = ctypes.c_int
    attn = lib.actorlm_paged_decode_kv
    attn.argtypes = [_P, _I, _P, _P, _I, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _I, _T]  # fmt: skip
    attn.restype = ctypes.c_int
    return lib


@dataclass
class MoEWeights:
    """A sparse MoE in place of a layer's dense MLP: each row's ``top_k`` experts of the
    router's softmax, their outputs weighted (renormalized to sum to 1 where
    ``renormalize``) and summed, as ``models.moe.SparseMoE`` computes it. With
    ``shared_gate``, the layer's ``gate_up`` and ``down`` are a shared expert that every
    row takes too, its output scaled by ``sigmoid(x . shared_gate)`` (Qwen2-MoE)."""

    router: torch.Tensor  # [experts, hidden]
    experts: list[tuple[Lin, Lin]]  # each expert's gate_up (rows [gate | up]) and down
    top_k: int
    renormalize: bool
    shared_gate: torch.Tensor | None = None  # [hidden]

    def check(self, hidden: int) -> str:
        """Why the kernel cannot run these experts, or "" when it can."""
        count, inter = len(self.experts), self.experts[0][1].k if self.experts else 0
        if self.router.shape != (count, hidden) or not 0 < self.top_k <= count:
            return "router or top k"
        if inter % 16 or any(
            (g.n, g.k, d.n, d.k) != (2 * inter, hidden, hidden, inter) for g, d in self.experts
        ):
            return f"expert sizes (intermediate {inter}: a multiple of 16 is needed)"
        return ""


@dataclass
class LayerWeights:
    qkv: Lin  # rows [q | k | v], heads in order
    o: Lin
    gate_up: Lin | None  # rows [gate | up]; with moe its shared expert's, or None
    down: Lin | None
    in_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor
    # [head_dim] each: every q and k head RMS-normed before RoPE (Qwen3), or None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # [hidden] each: the attention's and the MLP's outputs normed before the residual
    # takes them (Gemma's "post" norms; post_norm above is the one before the MLP)
    attn_out_norm: torch.Tensor | None = None
    ffn_out_norm: torch.Tensor | None = None
    window: int = 0  # keys each row attends to, its own the last (a sliding window); 0: all
    rope: int = 0  # which of the step's cos/sin tables turns q and k (Gemma 3's windows: 1)
    moe: MoEWeights | None = None  # experts in place of gate_up and down

    def dense(self) -> list[Lin]:
        """Its linears other than the experts'."""
        return [w for w in (self.qkv, self.o, self.gate_up, self.down) if w is not None]

    def lins(self) -> list[Lin]:
        """All its linears, the experts' included."""
        experts = [w for pair in self.moe.experts for w in pair] if self.moe else []
        return self.dense() + experts


@dataclass
class StepWeights:
    """A Llama-shaped decoder as the kernel reads it (pre-norm RMSNorm layers, RoPE in
    the halves layout, SiLU-gated MLP, any GQA grouping), or a Gemma one (its extras
    below and in LayerWeights)."""

    embed: torch.Tensor  # [vocab, hidden] fp32 or bf16
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    head: Lin  # [vocab, hidden]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    keep: list[Any] = field(default_factory=list)  # tensors the descriptors point into
    rotary_dim: int = 0  # RoPE on each head's first rotary_dim values (0: all head_dim)
    ropes: int = 1  # cos/sin tables a step passes (LayerWeights.rope picks one)
    embed_scale: float = 0.0  # the embeddings times this (0: not scaled)
    softcap: float = 0.0  # attention scores cap * tanh(s / cap) (0: none)
    final_softcap: float = 0.0  # the logits likewise
    act: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh"

    @property
    def windowed(self) -> bool:
        return any(layer.window for layer in self.layers)

    def check(self) -> str:
        """Why the kernel cannot run these weights, or "" when it can."""
        if (
            self.embed.dtype not in (torch.float32, torch.bfloat16)
            or not self.embed.is_contiguous()
        ):
            return f"embedding of dtype {self.embed.dtype}"
        if self.head_dim % 2 or self.num_heads % self.num_kv_heads:
            return "head layout"
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            return f"rotary dims {self.rotary_dim} of {self.head_dim}"
        if self.act not in ("silu", "gelu_tanh"):
            return f"activation {self.act}"
        hidden = self.embed.shape[1]
        for layer in self.layers:
            gate_up, down = layer.gate_up, layer.down
            dense = (gate_up is not None) + (down is not None)  # a dense MLP's linears
            if layer.moe is not None:
                if dense != (2 if layer.moe.shared_gate is not None else 0):
                    return "a shared expert without its gate, or a gate without it"
                if why := layer.moe.check(hidden):
                    return why
                if layer.ffn_out_norm is not None:
                    return "output norms of experts"
            elif dense != 2:
                return "no MLP"
            if gate_up and down and (gate_up.n != 2 * down.k or down.k % 16):
                return f"intermediate size {down.k} (a multiple of 16 is needed)"
            qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            if (layer.qkv.n, layer.qkv.k, layer.o.k, layer.o.n) != (
                qkv,
                hidden,
                self.num_heads * self.head_dim,
                hidden,
            ):
                return "linear shapes"
            qk = (layer.q_norm, layer.k_norm)
            if (qk[0] is None) != (qk[1] is None) or any(
                n is not None and n.shape != (self.head_dim,) for n in qk
            ):
                return "q and k norms"
            outs = (layer.attn_out_norm, layer.ffn_out_norm)
            if (outs[0] is None) != (outs[1] is None) or any(
                n is not None and n.shape != (hidden,) for n in outs
            ):
                return "output norms"
            if layer.window < 0 or not 0 <= layer.rope < self.ropes:
                return "window or RoPE table"
        return ""


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32).contiguous()


def _lin(lin: Lin, act_bf16: bool) -> Lin:
    """A copy of ``lin`` (the same weights) whose inputs may round to bf16 or not; the
    linear method's own descriptor stays as it was."""
    out = Lin.from_buffer_copy(lin)
    out.act_bf16 = int(act_bf16)
    return out


def _memory_available() -> int | None:
    """The memory the kernel says is available (``MemAvailable``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _tiles_fit(lins: list[Lin]) -> bool:
    """Whether the layers' AMX tiles (2 bytes a weight) take at most half the memory
    left: a large model keeps its memory for the KV pool and prompts expand the weights
    every step instead (as without tiles), said once in the log."""
    need = sum(-(-w.n // 16) * 16 * w.k * 2 for w in lins if w.k % QK == 0)
    avail = _memory_available()
    if avail is None or need <= avail // 2:
        return True
    log.warning(
        "the fused step's AMX tiles would take %d MiB of the %d MiB available: left out, "
        "its prompts expand the weights every step",
        need >> 20,
        avail >> 20,
    )
    return False


def _experts(moe: MoEWeights, bf16: bool) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """The router in fp32, the experts' linears as one array (gate_up and down each) and
    the shared expert's gate in fp32."""
    lins = [_lin(w, bf16) for pair in moe.experts for w in pair]
    gate = None if moe.shared_gate is None else _f32(moe.shared_gate)
    return _f32(moe.router), (Lin * len(lins))(*lins), gate


def _moe_fields(moe: MoEWeights, made: tuple[Any, ...], bf16: bool) -> tuple[Any, ...]:
    """``_Layer``'s fields from ``router`` on, for ``moe`` (``made`` by ``_experts``)."""
    router, lins, gate = made
    inter = moe.experts[0][1].k
    return (
        router.data_ptr(),
        lins,
        len(moe.experts),
        moe.top_k,
        inter,
        moe.renormalize,
        bf16,
        None if gate is None else gate.data_ptr(),
    )


# Rows of a cascade chunk read their shared pages together: at most this many query rows
# (step_attention.h's CASCADE_ROWS), so 5 sequences of the default model's 3 heads a KV head.
CASCADE_ROWS = 16


@dataclass(frozen=True)
class Cascade:
    """The rows of a decode step whose contexts begin in the same pages (a system prompt
    the prefix cache shares): the step reads those pages once for a chunk of rows, not
    once a row, and merges that part of each row's softmax with the part over its own
    tokens (cascade attention). At 16 sequences over a shared 1,024-token prompt the
    shared pages are ~90% of a step's KV reads."""

    row_shared: np.ndarray  # [B] int64: tokens at the start of each row's context it shares
    chunk_ptr: np.ndarray  # [chunks + 1] int64: where each chunk's rows start in chunk_rows
    chunk_rows: np.ndarray  # int64: rows, chunk after chunk

    # A group is rows that hold the same page at index MIN_PAGES - 1 (pages come from a
    # radix tree: the same page there means the same pages before it), sharing their
    # longest common run of whole pages. A step takes the cascade where its groups hold
    # MIN_ROWS rows or more and save re-reading MIN_SAVED_TOKENS tokens or more (rows
    # beyond one a chunk, times the shared tokens): below, the merge, the extra barrier
    # a layer and the shared parts' few tasks (a chunk's KV heads over the threads) cost
    # what they save. bench/cascade.py on the 2-core AMX Xeon, cascade against row by
    # row, one group: 2 rows over 2,048 shared tokens 0.98x, 4 over 1,024 0.98x, 4 over
    # 256 0.91x, 8 over 128 0.95x, 6 over 256 0.96x; 5 over 1,024 1.05x, 8 over 512
    # 1.03x, 16 over 1,024 1.14x; four groups of 4 over 1,024 each: see bench/README.md.
    MIN_PAGES = 4
    MIN_ROWS = 5
    MIN_SAVED_TOKENS = 2048

    @classmethod
    def find(
        cls, pages: np.ndarray, seq_lens: np.ndarray, page_size: int, group_size: int
    ) -> Cascade | None:
        """``pages`` [B, P] and ``seq_lens`` [B] of a step's decodes (one row a sequence,
        its new token the last of its length); chunks of at most ``group_size`` rows.
        None where too little would be saved."""
        B = len(seq_lens)
        full = (seq_lens - 1) // page_size  # whole pages before each row's new token
        probe = cls.MIN_PAGES - 1
        if B < cls.MIN_ROWS or group_size < 2 or pages.shape[1] <= probe:
            return None
        live = np.flatnonzero(full > probe)
        keys = pages[live, probe]
        order = live[np.argsort(keys, kind="stable")]
        _, starts, counts = np.unique(pages[order, probe], return_index=True, return_counts=True)
        row_shared = np.zeros(B, np.int64)
        ptr, rows, saved = [0], [], 0
        for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
            if count < 2:
                continue
            members = order[start : start + count]
            n = int(full[members].min())
            same = (pages[members, :n] == pages[members[0], :n]).all(axis=0)
            shared = (n if same.all() else int(same.argmin())) * page_size
            chunks = -(-count // group_size)
            saved += (count - chunks) * shared
            row_shared[members] = shared
            for part in np.array_split(members, chunks):  # near-equal chunks
                rows += part.tolist()
                ptr.append(len(rows))
        if len(rows) < cls.MIN_ROWS or saved < cls.MIN_SAVED_TOKENS:
            return None
        return cls(row_shared, np.asarray(ptr, np.int64), np.asarray(rows, np.int64))

    @staticmethod
    def sequences(num_heads: int, num_kv_heads: int) -> int:
        """The most sequences a chunk takes: CASCADE_ROWS query rows a KV head."""
        return CASCADE_ROWS // (num_heads // num_kv_heads)

    @staticmethod
    def args(cascade: Cascade | None) -> tuple[int | None, int | None, int | None, int]:
        """The kernels' row_shared, chunk_ptr, chunk_rows and n_chunks (0: no cascade)."""
        if cascade is None:
            return None, None, None, 0
        return (
            cascade.row_shared.ctypes.data,
            cascade.chunk_ptr.ctypes.data,
            cascade.chunk_rows.ctypes.data,
            len(cascade.chunk_ptr) - 1,
        )


class DecodeStep:
    """One model over one KV pool, built once; ``__call__`` runs a decode step."""

    def __init__(
        self,
        weights: StepWeights,
        kv: torch.Tensor,
        page_size: int,
        scale: float,
        level: str = "",
        tiles: bool = True,
    ) -> None:
        """``kv`` is the pool's tensor [layers, 2, kv_heads, pages, page_size, head_dim].
        ``tiles``: a bf16 model's layers keep their weights as AMX's tiles too, where the
        build for ``level`` runs them (``qgemm.amx_tiles``: 2 bytes a weight)."""
        lib = native_step(level)
        if lib is None:
            raise RuntimeError("the decode-step kernel cannot be built here")
        if kv.dtype not in (torch.float32, torch.bfloat16) or not kv.is_contiguous():
            raise ValueError(f"KV pool of dtype {kv.dtype}")
        self._fn = lib.actorlm_decode_step
        self.weights = weights
        self.kv_bf16 = kv.dtype == torch.bfloat16
        # a sequence's 8 or more new rows attend together (step_attention.h's flash_rows:
        # bf16 products where the build and pool have them, else fp32); False: a row at
        # a time
        self.extend_flash = True
        self.vocab = weights.head.n
        norms = [
            [
                _f32(n) if n is not None else None
                for n in (
                    x.in_norm,
                    x.post_norm,
                    x.q_norm,
                    x.k_norm,
                    x.attn_out_norm,
                    x.ffn_out_norm,
                )
            ]
            for x in weights.layers
        ]
        final = _f32(weights.final_norm)
        # a bf16 model's linears may round their inputs to bf16, as its forward does:
        # at larger batches they then take the CPU's bf16 dot products (gemv.h)
        bf16 = weights.embed.dtype == torch.bfloat16
        # and on AMX their weights rounded to bf16 once, as the tiles load them: steps of
        # many rows (prompts) then expand nothing (kernels/amx.h)
        lins = [w for x in weights.layers for w in x.dense()]
        arena = Arena() if bf16 and tiles and amx_ready(level) and _tiles_fit(lins) else None
        self.tiles: list[torch.Tensor] = []

        def lin(w: Lin) -> Lin:
            out = _lin(w, bf16)
            if arena is not None and (t := amx_tiles(out, arena, level)) is not None:
                self.tiles.append(t)
            return out

        # experts: no tiles (a step gives each expert a few of its rows)
        experts = [_experts(x.moe, bf16) if x.moe else None for x in weights.layers]
        layers = (_Layer * len(weights.layers))(
            *(
                _Layer(
                    *(lin(w) if w is not None else Lin() for w in (x.qkv, x.o, x.gate_up, x.down)),
                    *(n.data_ptr() if n is not None else None for n in ns),
                    x.window,
                    x.rope,
                    *(_moe_fields(x.moe, ex, bf16) if x.moe and ex else ()),
                )
                for x, ns, ex in zip(weights.layers, norms, experts, strict=True)
            )
        )
        self._keep = (norms, final, layers, kv, experts)
        self._model = _Model(
            num_layers=len(weights.layers),
            hidden=weights.embed.shape[1],
            heads=weights.num_heads,
            kv_heads=weights.num_kv_heads,
            head_dim=weights.head_dim,
            inter=max((x.down.k for x in weights.layers if x.down is not None), default=0),
            vocab=self.vocab,
            eps=weights.eps,
            scale=scale,
            layers=layers,
            embed=weights.embed.data_ptr(),
            embed_bf16=int(weights.embed.dtype == torch.bfloat16),
            final_norm=final.data_ptr(),
            head=_lin(weights.head, bf16),
            kv=kv.data_ptr(),
            kv_bf16=int(kv.dtype == torch.bfloat16),
            num_pages=kv.shape[3],
            page_size=page_size,
            rot_half=(weights.rotary_dim or weights.head_dim) // 2,
            embed_scale=weights.embed_scale,
            softcap=weights.softcap,
            final_softcap=weights.final_softcap,
            act_gelu=int(weights.act == "gelu_tanh"),
            split_keys=1,
        )

    def set_lora(self, descs: list[LoraDesc], max_rank: int) -> None:
        """Adapters for later steps: ``descs`` each layer's q, k, v, o, gate, up and down
        (``kernels/lora.py``, in that order), slots of rank at most ``max_rank``."""
        per_layer = 7
        if len(descs) != per_layer * len(self.weights.layers):
            raise ValueError(f"{len(descs)} LoRA descriptors for {len(self.weights.layers)} layers")
        array = (LoraDesc * len(descs))(*descs)
        self._lora = array  # the model points into it
        self._model.lora = ctypes.cast(array, ctypes.POINTER(LoraDesc))
        self._model.lora_rank = max_rank

    @property
    def has_lora(self) -> bool:
        return bool(self._model.lora)

    @property
    def split_keys(self) -> bool:
        """Whether a decode step of few (sequence, KV head) tasks attends over each long
        context in parts of its keys that any thread takes (step_attention.h); False: each
        task one thread's, over its whole context."""
        return bool(self._model.split_keys)

    @split_keys.setter
    def split_keys(self, on: bool) -> None:
        self._model.split_keys = int(on)

    @property
    def tiles_from(self) -> int:
        """Rows from which the next steps' block linears read the layers' AMX tiles (0:
        the kernels' own AMX_TILES_MIN_ROWS); fewer rows expand the blocks' codes each
        call. The same bits either way: only the bytes read differ."""
        return int(self._model.tiles_from)

    @tiles_from.setter
    def tiles_from(self, rows: int) -> None:
        self._model.tiles_from = rows

    def __call__(
        self,
        tokens: np.ndarray,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: np.ndarray,
        pages: np.ndarray,
        seq_lens: np.ndarray,
        threads: int = 0,
        row_slots: torch.Tensor | None = None,
        head_rows: np.ndarray | None = None,
        cascade: Cascade | None = None,
        picks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, slots, seq_lens [B] int64; cos, sin [ropes, B, rotary_dim / 2] fp32
        (or [B, rotary_dim / 2] for one table); pages
        [B, P] int64 → logits [B, vocab] fp32 (the pool gets each token's K and V), on
        ``threads`` threads (default torch's count; the results do not depend on it).
        ``row_slots`` [B] int32: each row's adapter slot (-1: the base model; needs
        ``set_lora``), or None for the base model alone. ``head_rows`` [N] int64,
        ascending: rows may be consecutive tokens of one sequence (each row's K and V
        reach the pool before any row attends), and only these N get logits [N, vocab].
        ``cascade``: rows whose contexts begin in the same pages (decodes alone, no
        ``head_rows``), which then read those pages once a chunk of rows. ``picks``:
        an int64 tensor of one entry a logits row that gets each row's argmax
        (``torch.argmax``'s answer), found as the head makes the logits."""
        B = tokens.shape[0]
        lora = None
        if row_slots is not None:
            if not self.has_lora:
                raise ValueError("adapter slots for a step without set_lora")
            if row_slots.dtype != torch.int32 or row_slots.shape != (B,):
                raise ValueError(f"row_slots must be [{B}] int32")
            lora = row_slots.contiguous()
        heads, n_head = None, B
        if head_rows is not None:
            if head_rows.dtype != np.int64 or not head_rows.flags.c_contiguous:
                raise ValueError("head_rows must be contiguous int64")
            heads, n_head = head_rows.ctypes.data, len(head_rows)
        logits = torch.empty(n_head, self.vocab)
        if picks is not None and (
            picks.dtype != torch.int64 or picks.shape != (n_head,) or not picks.is_contiguous()
        ):
            raise ValueError(f"picks must be [{n_head}] int64")
        half = self._model.rot_half
        for t in (cos, sin):
            if (
                t.dtype != torch.float32
                or not t.is_contiguous()
                or t.numel() != self.weights.ropes * B * half
            ):
                raise ValueError(f"cos and sin must be [{self.weights.ropes}, {B}, {half}] fp32")
        rc = self._fn(
            ctypes.byref(self._model), B, tokens.ctypes.data, cos.data_ptr(), sin.data_ptr(),
            slots.ctypes.data, pages.ctypes.data, pages.shape[1], seq_lens.ctypes.data,
            int(seq_lens.max()), logits.data_ptr(), None if lora is None else lora.data_ptr(),
            (2 if self.extend_flash else 1) if heads is not None else 0, heads, n_head,
            *Cascade.args(cascade if heads is None else None),
            None if picks is None else picks.data_ptr(), threads or torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("decode step: out of memory for its scratch")
        return logits
