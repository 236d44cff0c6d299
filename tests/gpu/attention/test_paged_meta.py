"""The CSR page metadata the CUDA backends plan from (``paged_meta``), against the torch
backend's view of the same ragged batch, and flashinfer's plan arguments read back by a
plain-torch rendering of flashinfer's paged-attention semantics."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.attention.paged_meta import (
    FlashInferPlan,
    extend_schedule,
    flashinfer_plan,
    paged_kv,
    split_decodes,
)
from actorlm.gpu.attention.torch_native import TorchNativeBackend

from .ragged import MIXED, Step, ragged_step, rebuild

CPU = torch.device("cpu")


@pytest.mark.parametrize("page_size", [1, 16])
def test_groups_match_the_torch_backends_view(page_size: int) -> None:
    step = ragged_step(MIXED, 4, 2, 64, page_size, torch.float32, CPU)
    meta = rebuild(step)
    TorchNativeBackend(step.pool, 4, 64).init_forward_metadata(meta)
    ref = meta.attn[
        0
    ]  # the torch backend's plan (no window): a decode group, one entry per prefill
    decodes, extends = split_decodes(meta)
    dec = paged_kv(meta, decodes)
    assert dec.seqs.tolist() == decodes and ref.decode.seq_lens == dec.kv_lens.tolist()
    for b in range(dec.size):
        n = -(-ref.decode.seq_lens[b] // page_size)
        assert dec.pages(b).tolist() == ref.decode.table[b, :n].tolist()
    ext = paged_kv(meta, extends)
    assert len(ref.prefills) == ext.size
    for i, p in enumerate(ref.prefills):
        assert (p.rows.start, p.rows.stop) == (ext.q_start[i], ext.q_start[i] + ext.q_len[i])
        assert p.start_pos == ext.prefix[i]
        # a fresh prompt reads its own K/V (no pages in the torch plan): its table's head
        want = p.pages.tolist() if p.pages is not None else meta.page_tables[extends[i]]
        assert ext.pages(i).tolist() == want[: len(ext.pages(i))]
    for kv in (dec, ext):  # the last page holds the rest, 1..page_size tokens
        npages = np.diff(kv.kv_indptr)
        assert ((npages - 1) * page_size + kv.kv_last_page_len == kv.kv_lens).all()
        assert (kv.kv_last_page_len >= 1).all() and (kv.kv_last_page_len <= page_size).all()
        assert kv.kv_indptr.dtype == kv.kv_indices.dtype == np.int32


def test_short_page_table_is_refused() -> None:
    step = ragged_step([(0, 20)], 2, 1, 64, 16, torch.float32, CPU)
    meta = rebuild(step)
    meta.page_tables[0] = meta.page_tables[0][:1]
    with pytest.raises(ValueError, match="short of 2"):
        paged_kv(meta)


def test_extend_schedule_lists_every_block_once() -> None:
    seq, start = extend_schedule(np.array([70, 1, 0, 32], dtype=np.int32), 32)
    assert seq.tolist() == [0, 0, 0, 1, 3] and start.tolist() == [0, 32, 64, 0, 0]
    assert extend_schedule(np.zeros(0, np.int32), 32)[0].size == 0


def flashinfer_reference(
    plan: FlashInferPlan, step: Step, layer: int, scale: float
) -> torch.Tensor:
    """flashinfer's paged attention as its documentation defines it, in plain torch, read
    from the arguments ``plan`` would pass: HND pages ``[pages, Hkv, page_size, D]``,
    sequence i's keys the first ``(n - 1) * page_size + last_page_len[i]`` slots of its
    ``n`` pages, its queries rows ``qo_indptr[i]..`` (decode: one each), causal aligned to
    the end of the keys."""
    pool = step.pool
    k_hnd = pool.k_pages(layer).transpose(0, 1)
    v_hnd = pool.v_pages(layer).transpose(0, 1)
    H, ps = plan.args[-4], plan.args[-1]
    if plan.wrapper == "decode":
        indptr, indices, last = plan.args[:3]
        qo = np.arange(indptr.shape[0])
    else:
        qo, indptr, indices, last = plan.args[:4]
    out = torch.empty(step.q.shape[0], H * step.q.shape[2])
    for i in range(indptr.shape[0] - 1):
        pages = torch.from_numpy(indices[indptr[i] : indptr[i + 1]]).long()
        kv_len = (pages.numel() - 1) * ps + int(last[i])
        keys = (
            k_hnd[pages].transpose(0, 1).reshape(pool.num_kv_heads, -1, pool.head_dim)[:, :kv_len]
        )
        vals = (
            v_hnd[pages].transpose(0, 1).reshape(pool.num_kv_heads, -1, pool.head_dim)[:, :kv_len]
        )
        q = step.q[qo[i] : qo[i + 1]].transpose(0, 1)  # [H, n, D]
        n = q.shape[1]
        mask = torch.arange(kv_len)[None, :] <= torch.arange(n)[:, None] + (kv_len - n)
        o = F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[qo[i] : qo[i + 1]] = o.transpose(0, 1).reshape(n, -1)
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "spans", [MIXED, [(9, 1), (0, 1), (47, 1), (16, 1)]], ids=["mixed", "decodes"]
)
def test_flashinfer_plan_reads_back_as_the_torch_backends_attention(
    spans: list[tuple[int, int]], page_size: int
) -> None:
    step = ragged_step(spans, 8, 2, 64, page_size, torch.float32, CPU)
    ref = TorchNativeBackend(step.pool, 8, 64)
    meta = rebuild(step)
    ref.init_forward_metadata(meta)
    want = ref.forward(step.q, step.k, step.v, 1, meta)  # also writes the new K/V
    plan = flashinfer_plan(meta, 8, 2, 64, ref.scale, "float32")
    decode_only = all(n == 1 for _, n in spans)
    assert plan.wrapper == ("decode" if decode_only else "prefill")
    assert plan.args[-4:] == (8, 2, 64, page_size)
    assert plan.kwargs["sm_scale"] == ref.scale and plan.kwargs["q_data_type"] == "float32"
    assert plan.kwargs.get("causal", False) is not decode_only
    if not decode_only:  # qo_indptr: the packed rows, sequence after sequence
        assert plan.args[0].tolist() == [*meta.row_starts, meta.num_tokens]
    got = flashinfer_reference(plan, step, 1, ref.scale)
    assert (got - want).abs().max().item() < 1e-5


def test_the_builders_import_neither_torch_nor_flashinfer() -> None:
    # the page metadata and the LoRA batch contract are pure numpy
    code = (
        "import sys, actorlm.gpu.attention.paged_meta, actorlm.gpu.lora.batch; "
        "print(sorted(m for m in ('torch', 'flashinfer', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
