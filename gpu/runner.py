"""ForwardBatch → next tokens: the model, its paged KV pool, the attention backend
and the sampler, wired together. No messaging and no scheduling here: the worker
actor calls ``forward`` once per step (off its event loop)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec
import torch
from actorlm.config import ModelConfig
from actorlm.extensions.points import ATTENTION_BACKENDS, QUANTIZATION_METHODS
from actorlm.extensions.registry import import_object
from actorlm.messages.step import (
    PENDING_TOKEN,
    ForwardBatch,
    SeqError,
    SeqInit,
    SeqResult,
    SeqStep,
    StepResult,
)

from . import (
    attention,  # noqa: F401  (registers the built-in backends)
    onednn,
)
from .cuda_graphs import capture_decode_graphs, use_cuda_graphs
from .cuda_step import check_pool_fits, upload_meta
from .forward_meta import ForwardMeta, SeqSpec
from .fused_decode import FusedDecoder
from .grammar.manager import GrammarManager
from .loaders.base import load_model, make_loader
from .model_info import ModelInfo, kv_pages_for_budget
from .models.base import CausalLM
from .platforms import Platform, device_platform, resolve_dtype
from .quantization import GGUFLinear, GGUFMethod, quantize_model

if TYPE_CHECKING:
    from .lora.pool import LoraMemoryPool

__all__ = ["ModelRunner"]

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig) -> None:
        # Loading runs on one thread, serving on all: the load's ops are memory-bound, and
        # each of its ~1000 parallel regions waits for a thread on every other core, which
        # on busy cores (a restart under load) costs milliseconds a region: 3-4 s of a
        # worker start on one thread, 10-11 s on two.
        torch.set_num_threads(1)
        try:
            self._load(cfg)
        finally:
            torch.set_num_threads(cfg.num_threads or len(os.sched_getaffinity(0)))

    def _load(self, cfg: ModelConfig) -> None:
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device or "cpu")
        platform = device_platform(str(self.device))
        dtype = resolve_dtype(cfg.dtype, str(self.device))  # "auto": the platform's
        cfg = msgspec.structs.replace(cfg, device=str(self.device), dtype=dtype)
        self.cfg = cfg
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        platform.set_device(self.device.index or 0)
        loader = make_loader(cfg)
        info = loader.model_info()
        max_len = cfg.max_model_len or info.max_model_len
        method = QUANTIZATION_METHODS.get(cfg.quantization or "none")()
        method.check(self.device, self.dtype)
        load_dtype = method.load_dtype(self.dtype)
        num_pages = cfg.num_pages or kv_pages_for_budget(
            info, platform.kv_cache_bytes(cfg, info), cfg.page_size, cfg.dtype
        )
        self.model, _ = load_model(
            msgspec.structs.replace(cfg, dtype=str(load_dtype).removeprefix("torch.")),
            max_model_len=max_len,
            loader=loader,
        )
        if converted := quantize_model(self.model, method):
            log.info("quantization %s: %d linear layers converted", method.name, converted)
        if isinstance(method, GGUFMethod) and not any(
            isinstance(m, GGUFLinear) for m in self.model.modules()
        ):
            log.info(
                "quantization gguf: these weights are not GGUF blocks, so decode reads them "
                "dense; --quantization q8_0 or q4_1 rounds them to blocks as they load"
            )
        if load_dtype != self.dtype:
            self.model.to(self.dtype)  # what the method left unconverted (embeddings, norms)
        graphs = use_cuda_graphs(cfg, self.device, platform)
        pages = num_pages + int(graphs)  # CUDA graphs: one page more, where padding rows write
        check_pool_fits(self.device, info, pages, cfg.page_size, cfg.dtype, platform)
        pool_cls = import_object(platform.kv_pool_class)  # KVPool on the CPU
        self.pool = pool_cls(
            info.num_layers,
            pages,
            cfg.page_size,
            info.num_kv_heads,
            info.head_dim,
            self.dtype,
            self.device,
        )
        log.info(
            "KV pool: %d pages of %d tokens, %.1f MiB",
            num_pages,
            cfg.page_size,
            self.pool.nbytes / 2**20,
        )
        on_platform = self.device.type == platform.device_type
        self.attention_backend = cfg.attention_backend or (
            platform.default_attention_backend() if on_platform else "torch"
        )
        backend_cls = ATTENTION_BACKENDS.get(self.attention_backend)
        # The model's attention layout: softmax scale, per-layer windows, logit soft cap.
        self.layer_windows = list(getattr(self.model, "layer_windows", []))
        self.softcap = float(getattr(self.model, "attention_softcap", 0.0))
        for needed, supported, what in (
            (any(self.layer_windows), backend_cls.supports_sliding_window, "sliding-window"),
            (self.softcap, backend_cls.supports_logit_softcap, "soft-capped"),
        ):
            if needed and not supported:
                raise ValueError(
                    f"{info.architecture} needs {what} attention, which attention backend "
                    f"{self.attention_backend!r} does not implement; use --attention-backend torch"
                )
        scale = getattr(self.model, "attention_scale", None)
        self.backend = backend_cls(self.pool, info.num_heads, info.head_dim, scale=scale)
        self.info: ModelInfo = msgspec.structs.replace(
            info,
            max_model_len=max_len,
            num_pages=num_pages,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
        )
        from .sampling import Sampler

        self.sampler = Sampler(info.vocab_size, self.device)
        self._argmax_wanted = False  # this step's rows all greedy (forward sets it)
        self._last: dict[str, int] = {}  # each sequence's last sampled token (PENDING_TOKEN)
        self._prompt_lens: dict[str, int] = {}  # rid → prompt length, while it runs
        # Structured output: the worker sets this (it knows the tokenizer); None serves none.
        self.grammars: GrammarManager | None = None
        self.graphs = capture_decode_graphs(self, max_len, pad_page=num_pages) if graphs else None
        self.fused, why = (
            (None, "CUDA graphs")
            if graphs
            else FusedDecoder.build(self.model, self.backend, cfg.fused_decode_max_batch)
        )
        # bf16 weights packed once for oneDNN, but not those the fused step reads plain,
        # nor transformers' own modules under the fallback (its code may read them)
        if onednn.available(self.device, self.dtype) and isinstance(self.model, CausalLM):
            plain = self.fused.weight_ptrs() if self.fused else set()
            packed = onednn.pack_linears(self.model, plain)
            log.info("%d bf16 linear layers packed for oneDNN", packed)
        log.info(
            "dtype %s, kernels %s; %s",
            cfg.dtype,
            _isa_words(platform),
            f"decodes and short extensions in steps of <= {self.fused.max_batch} rows as one "
            f"native call{self.fused.tiles_words()}"
            + ("; larger steps as several such calls" if self.fused.splits else "")
            if self.fused
            else f"decode through the model ({why})",
        )
        self.lora: LoraMemoryPool | None = None  # adapter slots, once enable_lora ran

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Give the model ``num_slots`` adapter slots of rank ``max_rank`` (on top of the
        linear method). Decode steps with an adapter then run eagerly on CUDA (a captured
        graph has no adapter plan); the fused CPU step reads the slots itself where the
        native LoRA kernel builds, and else serves the base model's steps alone."""
        from .lora.layers import install_lora
        from .lora.pool import LoraMemoryPool
        from .lora.targets import BaseShapes, placements

        shapes = BaseShapes.from_info(self.info)
        self.lora = LoraMemoryPool(shapes, num_slots, max_rank, self.dtype, self.device)
        wrapped = install_lora(self.model, self.lora, placements(self.info))
        self.graphs = None
        fused = self.fused is not None and self.fused.attach_lora(self.lora)
        log.info(
            "LoRA: %d slots of rank %d on %d projections, %.1f MiB; decode steps with adapters %s",
            num_slots,
            max_rank,
            wrapped,
            self.lora.nbytes / 2**20,
            "fused" if fused else "through the model",
        )

    def forward(self, batch: ForwardBatch) -> StepResult:
        """One step: results for the sequences with ``sample=True``, in batch order."""
        t0 = time.perf_counter()
        grammars = self.grammars
        for rid in batch.release:
            self.sampler.release(rid)
            self._last.pop(rid, None)
            self._prompt_lens.pop(rid, None)
            if grammars is not None:
                grammars.release(rid)
        errors: list[SeqError] = []
        for s in batch.seqs:  # a step sent while the one before failed this sequence
            if PENDING_TOKEN in s.input_ids and s.rid not in self._last:
                errors.append(SeqError(s.rid, "its previous step failed"))
        seqs = [
            self._resolve(s)
            for s in batch.seqs
            if not errors or s.rid not in {e.rid for e in errors}
        ]
        for s in batch.seqs:
            if s.init is not None:
                self._prompt_lens[s.rid] = s.init.prompt_len
                try:
                    self.sampler.add(s.rid, s.init)  # builds its logit processors
                    self._start_grammar(s.rid, s.init)
                except ValueError as exc:
                    errors.append(SeqError(s.rid, str(exc)))
        if errors:
            failed = {e.rid for e in errors}
            seqs = [s for s in seqs if s.rid not in failed]
        plan = None
        if self.lora is not None and batch.lora_ids:
            seqs, plan = self.lora.plan_step(seqs, batch, errors)
        results = []
        rids = [s.rid for s in seqs if s.sample]
        if seqs:
            # The constrained rows' masks fill on the grammar thread while the model runs;
            # a batch without constrained rows pays nothing.
            fill, constrained = None, []
            if grammars is not None and len(grammars):
                constrained = [i for i, rid in enumerate(rids) if rid in grammars]
                if constrained:
                    fill = grammars.fill_async([rids[i] for i in constrained])
            if self.lora is not None:
                self.lora.plan = plan
            # a greedy step with nothing to apply: the fused step finds the argmax itself
            self._argmax_wanted = bool(rids) and fill is None and self.sampler.argmax_only(rids)
            try:
                logits = self.forward_logits(seqs)
            finally:
                self._argmax_wanted = False
                if self.lora is not None:
                    self.lora.plan = None
            if rids:
                masks = None
                if fill is not None:
                    masks = {constrained[j]: row for j, row in fill.result().items()}
                results = self.sampler.sample(rids, logits, masks)
                self._last.update((r.rid, r.token_id) for r in results)
            if fill is not None:
                errors += self._advance_grammars(results)
            if plan is not None:  # grouped by adapter above: back to batch order
                order = {s.rid: i for i, s in enumerate(batch.seqs)}
                results.sort(key=lambda r: order[r.rid])
        return StepResult(
            step_id=batch.step_id,
            results=results,
            errors=errors,
            forward_ms=(time.perf_counter() - t0) * 1e3,
        )

    def release_all(self) -> None:
        """Forget every sequence (their scheduler is gone)."""
        self.sampler.release_all()
        self._last.clear()
        self._prompt_lens.clear()

    def _resolve(self, seq: SeqStep) -> SeqStep:
        """Fill in a PENDING_TOKEN input with the token the sequence sampled last."""
        if PENDING_TOKEN not in seq.input_ids:
            return seq
        ids = [self._last[seq.rid] if t == PENDING_TOKEN else t for t in seq.input_ids]
        return msgspec.structs.replace(seq, input_ids=ids)

    def _start_grammar(self, rid: str, init: SeqInit) -> None:
        if init.sampling.constraint is None:
            return
        if self.grammars is None:
            raise ValueError("this worker serves no structured output")
        self.grammars.start(rid, init.sampling, init.token_ids, init.prompt_len)

    def _advance_grammars(self, results: list[SeqResult]) -> list[SeqError]:
        """Each constrained row's matcher takes its sampled token. One that refuses it (a
        mask left nothing but a banned token, min_new_tokens say) ends that request."""
        assert self.grammars is not None
        refused = self.grammars.accept_all([(r.rid, r.token_id) for r in results])
        message = "the output can no longer match its constraint"
        return [SeqError(rid, message) for rid in refused]

    def forward_logits(self, seqs: list[SeqStep]) -> torch.Tensor:
        """Raw logits [S, V] fp32 for the sequences with ``sample=True`` (the KV pool is updated)."""
        return self.run(
            [
                SeqSpec(
                    s.input_ids, s.start_pos, s.page_ids, s.sample, self._prompt_lens.get(s.rid, 0)
                )
                for s in seqs
            ]
        )

    @torch.inference_mode()
    def run(self, seqs: list[SeqSpec]) -> torch.Tensor:
        for s in seqs:
            if s.start_pos + len(s.input_ids) > self.info.max_model_len:
                raise ValueError(
                    f"sequence of {s.start_pos + len(s.input_ids)} tokens exceeds max_model_len {self.info.max_model_len}"
                )
            if s.page_ids and max(s.page_ids) >= self.info.num_pages:
                raise ValueError(
                    f"page id {max(s.page_ids)} out of range (pool has {self.info.num_pages})"
                )
        if self.graphs is not None and self.graphs.can_run(seqs):
            return self.graphs.run(seqs)
        plan = None if self.lora is None else self.lora.plan
        if self.fused is not None:
            offer = self.sampler.offer_argmax if self._argmax_wanted else None
            if self.fused.accepts(seqs, plan):
                return self.fused.run(seqs, plan, offer)
            if (calls := self.fused.split(seqs, plan)) is not None:
                return self.fused.run_split(calls, offer)
        meta = ForwardMeta.build(seqs, self.pool.page_size, "cpu", self.layer_windows, self.softcap)
        if self.device.type != "cpu":
            meta = upload_meta(meta, self.device)  # pinned, non-blocking
        self.backend.init_forward_metadata(meta)
        return self.model(meta, self.backend)


def _isa_words(platform: Platform) -> str:
    """The kernels' ISA for the start-up log, saying when an amx build has no tiles."""
    isa = platform.kernel_isa() or "none"
    if isa == "amx" and platform.describe().get("amx_tiles") is False:
        return "amx (tiles refused by the kernel: AVX512-BF16 dot products)"
    return isa
