"""ForwardBatch → next tokens: the model, its paged KV pool, the attention backend
and the sampler, wired together. No messaging and no scheduling here: the worker
actor calls ``forward`` once per step (off its event loop)."""

from __future__ import annotations

import logging
import os
import time

import msgspec
import torch
from actorlm.config import ModelConfig
from actorlm.extensions.plugins import current_platform
from actorlm.extensions.points import ATTENTION_BACKENDS, QUANTIZATION_METHODS
from actorlm.extensions.registry import import_object
from actorlm.messages.step import ForwardBatch, SeqError, SeqStep, StepResult

from . import attention  # noqa: F401  (registers the built-in backends)
from .forward_meta import ForwardMeta, SeqSpec
from .fused_decode import FusedDecoder
from .loaders.base import load_model, make_loader
from .model_info import ModelInfo, kv_pages_for_budget
from .quantization import quantize_model

__all__ = ["ModelRunner"]

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig) -> None:
        torch.set_num_threads(cfg.num_threads or len(os.sched_getaffinity(0)))
        torch.manual_seed(cfg.seed)
        platform = current_platform()
        if cfg.dtype == "auto":
            cfg = msgspec.structs.replace(cfg, dtype=platform.default_dtype())
        self.cfg = cfg
        self.device = torch.device(cfg.device or "cpu")
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        loader = make_loader(cfg)
        info = loader.model_info()
        max_len = cfg.max_model_len or info.max_model_len
        if info.sliding_window and max_len > info.sliding_window:
            # Attention here is full, not windowed: within the window both agree.
            log.info(
                "capping max_model_len %d to the sliding window %d", max_len, info.sliding_window
            )
            max_len = info.sliding_window
        method = QUANTIZATION_METHODS.get(cfg.quantization or "none")()
        method.check(self.device, self.dtype)
        load_dtype = method.load_dtype(self.dtype)
        self.model, _ = load_model(
            msgspec.structs.replace(cfg, dtype=str(load_dtype).removeprefix("torch.")),
            max_model_len=max_len,
            loader=loader,
        )
        if converted := quantize_model(self.model, method):
            log.info("quantization %s: %d linear layers converted", method.name, converted)
        if load_dtype != self.dtype:
            self.model.to(self.dtype)  # what the method left unconverted (embeddings, norms)
        num_pages = cfg.num_pages or kv_pages_for_budget(
            info, cfg.kv_cache_gb * 2**30, cfg.page_size, cfg.dtype
        )
        pool_cls = import_object(platform.kv_pool_class)  # KVPool on the CPU
        self.pool = pool_cls(
            info.num_layers,
            num_pages,
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
        self.attention_backend = cfg.attention_backend or platform.default_attention_backend()
        backend_cls = ATTENTION_BACKENDS.get(self.attention_backend)
        self.backend = backend_cls(self.pool, info.num_heads, info.head_dim)
        self.info: ModelInfo = msgspec.structs.replace(
            info,
            max_model_len=max_len,
            num_pages=num_pages,
            page_size=cfg.page_size,
            dtype=cfg.dtype,
        )
        from .sampling import Sampler

        self.sampler = Sampler(info.vocab_size, self.device)
        self.fused, why = FusedDecoder.build(self.model, self.backend, cfg.fused_decode_max_batch)
        log.info(
            "dtype %s, kernels %s; decode %s",
            cfg.dtype,
            platform.kernel_isa(),
            f"steps of <= {self.fused.max_batch} sequences as one native call"
            if self.fused
            else f"through the model ({why})",
        )

    def forward(self, batch: ForwardBatch) -> StepResult:
        """One step: results for the sequences with ``sample=True``, in batch order."""
        t0 = time.perf_counter()
        for rid in batch.release:
            self.sampler.release(rid)
        errors: list[SeqError] = []
        seqs = batch.seqs
        for s in batch.seqs:
            if s.init is not None:
                try:
                    self.sampler.add(s.rid, s.init)  # builds its logit processors
                except ValueError as exc:
                    errors.append(SeqError(s.rid, str(exc)))
        if errors:
            failed = {e.rid for e in errors}
            seqs = [s for s in seqs if s.rid not in failed]
        results = []
        rids = [s.rid for s in seqs if s.sample]
        if seqs:
            logits = self.forward_logits(seqs)
            if rids:
                results = self.sampler.sample(rids, logits)
        return StepResult(
            step_id=batch.step_id,
            results=results,
            errors=errors,
            forward_ms=(time.perf_counter() - t0) * 1e3,
        )

    def forward_logits(self, seqs: list[SeqStep]) -> torch.Tensor:
        """Raw logits [S, V] fp32 for the sequences with ``sample=True`` (the KV pool is updated)."""
        return self.run([SeqSpec(s.input_ids, s.start_pos, s.page_ids, s.sample) for s in seqs])

    @torch.inference_mode()
    def run(self, seqs: list[SeqSpec]) -> torch.Tensor:
        for s in seqs:
            if s.start_pos + len(s.input_ids) > self.info.max_model_len:
                raise ValueError(
                    f"sequence of {s.start_pos + len(s.input_ids)} tokens exceeds max_model_len {self.info.max_model_len}"
                )
            if s.page_ids and max(s.page_ids) >= self.pool.num_pages:
                raise ValueError(
                    f"page id {max(s.page_ids)} out of range (pool has {self.pool.num_pages})"
                )
        if self.fused is not None and self.fused.accepts(seqs):
            return self.fused.run(seqs)
        meta = ForwardMeta.build(seqs, self.pool.page_size, self.device)
        self.backend.init_forward_metadata(meta)
        return self.model(meta, self.backend)
