"""LoRA in the worker's model: adapters read from PEFT's files, put in slots, computed for
a whole batch that mixes them with the base model, against ``peft`` on the same files;
the same on top of the fp16 and GGUF linear methods; the CPU path against the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.actors.lora_loader.peft import AdapterWeights, read_adapter
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.lora.batch import BASE, LoraBatch
from actorlm.gpu.lora.layers import LoRALayer
from actorlm.gpu.lora.ops import (
    LoraWeights,
    lora_apply_gathered,
    lora_apply_segments,
    lora_apply_torch,
)
from actorlm.gpu.lora.plan import LoraPlan
from actorlm.gpu.lora.targets import BaseShapes
from actorlm.gpu.quantization import GGUFLinear, fbgemm_available
from actorlm.gpu.runner import ModelRunner
from actorlm.messages.step import ForwardBatch
from torch import nn

from ..helpers import Pages, Seq, hf_greedy, hf_last_logits, hf_model, make_runner

PROMPTS = {
    "": [5, 17, 923, 4, 4, 88, 1200, 31, 7],
    "sql": list(range(100, 141)),
    "chat": [42, 42, 7, 19000, 3],
    "all": [9, 8, 7, 6, 5, 4, 3, 2, 1, 300],
    "sparse": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
}


def adapter(path: Path, runner: ModelRunner, name: str) -> AdapterWeights:
    return read_adapter(name, str(path), BaseShapes.from_info(runner.info), 16)


def lora_runner(path: Path, adapters: dict[str, Path], **overrides: Any) -> ModelRunner:
    """A runner with every adapter in a slot of its own (ids: the adapters' names)."""
    runner = make_runner(path, **overrides)
    runner.enable_lora(len(adapters) + 1, 16)
    assert runner.lora is not None
    for slot, (name, folder) in enumerate(adapters.items()):
        w = adapter(folder, runner, name)
        runner.lora.load(slot, name, [(m, a, b) for m, (a, b) in w.targets.items()])
    return runner


def peft_model(base: Path, adapter_dir: Path | None) -> Any:
    from peft import PeftModel

    model = hf_model(base)
    return (
        model if adapter_dir is None else PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    )


def mixed_prefill(runner: ModelRunner, names: list[str], native: bool = False) -> torch.Tensor:
    """One batched prefill of PROMPTS[name] for each name (its adapter; "" the base);
    ``native``: through the CPU's LoRA kernel, else torch's matmuls."""
    assert runner.lora is not None
    pages = Pages()
    specs = [
        SeqSpec(PROMPTS[n], 0, pages.table(f"r{i}", len(PROMPTS[n]))) for i, n in enumerate(names)
    ]
    slots = [BASE if not n else runner.lora.slot_of(n) for n in names]
    order = sorted(range(len(names)), key=lambda i: slots[i])  # rows grouped by slot
    lens = [len(specs[i].input_ids) for i in order]
    runner.lora.plan = LoraPlan.build(
        lens, [slots[i] for i in order], runner.lora.ranks, native=native
    )
    try:
        logits = runner.run([specs[i] for i in order])
    finally:
        runner.lora.plan = None
    return logits[torch.tensor(sorted(range(len(order)), key=lambda j: order[j]))]


@pytest.fixture(scope="module")
def runner(tiny_llama: Path, lora_adapters: dict[str, Path]) -> ModelRunner:
    return lora_runner(tiny_llama, lora_adapters, quantization="none")


@pytest.mark.parametrize("path", ["gather", "segments", "native"])
def test_a_mixed_prefill_matches_peft_for_every_adapter_and_the_base(
    runner: ModelRunner,
    tiny_llama: Path,
    lora_adapters: dict[str, Path],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import actorlm.gpu.lora.plan as plan

    # the CPU path is chosen by the padding gathering would compute: force each in turn
    monkeypatch.setattr(plan, "MAX_PADDING", 1e9 if path == "gather" else -1.0)
    assert runner.lora is not None
    native = path == "native"
    if native and not runner.lora.native:
        pytest.skip("the native kernel needs a C compiler")
    chosen = LoraPlan.build([3, 40], [0, 1], runner.lora.ranks, native=native)
    assert (chosen.gather is not None) == (path == "gather")
    assert (chosen.rows is not None) == native
    names = ["sql", "", "chat", "all", "sql", "sparse"]
    logits = mixed_prefill(runner, names, native)
    for i, name in enumerate(names):
        ref = hf_last_logits(peft_model(tiny_llama, lora_adapters.get(name)), PROMPTS[name])
        assert (logits[i] - ref).abs().max().item() < 1e-4, name
    base = hf_last_logits(hf_model(tiny_llama), PROMPTS["sql"])
    assert (logits[0] - base).abs().max().item() > 0.1  # the adapter does change the output


def test_greedy_decoding_of_a_mixed_batch_matches_peft(
    runner: ModelRunner, tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    """Five sequences decode together through ``forward`` (which groups their rows by
    slot and puts the results back in batch order), each with its own adapter."""
    names = ["chat", "", "sql", "sparse", "all"]
    pages = Pages()
    seqs = [Seq(f"g{i}", PROMPTS[n], pages) for i, n in enumerate(names)]
    for step in range(12):
        batch = ForwardBatch(step_id=step, seqs=[s.step() for s in seqs], lora_ids=names)
        result = runner.forward(batch)
        assert [r.rid for r in result.results] == [s.rid for s in seqs]  # batch order
        for seq, res in zip(seqs, result.results, strict=True):
            seq.out.append(res.token_id)
    runner.forward(ForwardBatch(step_id=99, seqs=[], release=[s.rid for s in seqs]))
    for seq, name in zip(seqs, names, strict=True):
        ref = hf_greedy(peft_model(tiny_llama, lora_adapters.get(name)), PROMPTS[name], 12)
        assert seq.out == ref, name


def test_a_sequence_whose_adapter_is_in_no_slot_is_refused_alone(runner: ModelRunner) -> None:
    pages = Pages()
    seqs = [Seq("ok", PROMPTS["sql"], pages), Seq("gone", PROMPTS["chat"], pages)]
    batch = ForwardBatch(step_id=0, seqs=[s.step() for s in seqs], lora_ids=["sql", "missing"])
    result = runner.forward(batch)
    assert [r.rid for r in result.results] == ["ok"]
    assert [e.rid for e in result.errors] == ["gone"] and "not loaded" in result.errors[0].message
    runner.forward(ForwardBatch(step_id=1, seqs=[], release=["ok", "gone"]))


def test_a_slot_loaded_again_serves_the_new_adapter(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    runner = lora_runner(tiny_llama, {"sql": lora_adapters["sql"]}, quantization="none")
    assert runner.lora is not None
    w = adapter(lora_adapters["chat"], runner, "chat")
    runner.lora.load(0, "chat", [(m, a, b) for m, (a, b) in w.targets.items()])
    assert runner.lora.slot_of("sql") is None and runner.lora.slot_of("chat") == 0
    ref = hf_last_logits(peft_model(tiny_llama, lora_adapters["chat"]), PROMPTS["chat"])
    assert (mixed_prefill(runner, ["chat"])[0] - ref).abs().max().item() < 1e-4  # no sql left
    with pytest.raises(ValueError, match="do not fit"):
        a, b = w.targets["k_proj"]
        runner.lora.load(0, "bad", [("k_proj", a[:, :, :-1], b)])


def _fp16_rounded(path: Path, adapter_dir: Path) -> Any:
    """peft over the base model with its linear weights rounded to fp16 (what the fp16
    method computes with); the adapters stay fp32, as in the worker."""
    from peft import PeftModel

    model = hf_model(path)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not model.lm_head:
                module.weight.copy_(module.weight.half().float())
        head = model.lm_head.weight.detach().half().float().clone()
        model.lm_head.weight = nn.Parameter(head, requires_grad=False)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


@pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm (x86 PyTorch)")
def test_adapters_on_top_of_the_fp16_method(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    runner = lora_runner(tiny_llama, lora_adapters, quantization="fp16")
    logits = mixed_prefill(runner, ["all", "chat"])
    for row, name in enumerate(["all", "chat"]):
        ref = hf_last_logits(_fp16_rounded(tiny_llama, lora_adapters[name]), PROMPTS[name])
        assert (logits[row] - ref).abs().max().item() < 1e-4, name


@pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm (x86 PyTorch)")
def test_adapters_on_top_of_gguf_blocks(
    tiny_llama: Path,
    lora_adapters: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ..kernels.test_qgemm import _block_model

    path = _block_model(tiny_llama, tmp_path / "blocks")
    monkeypatch.setattr(GGUFLinear, "KERNEL_MAX_ROWS", 1 << 30)  # every row through the kernel
    runner = lora_runner(path, lora_adapters, quantization="gguf")
    wrapped = [m for m in runner.model.modules() if isinstance(m, LoRALayer)]
    assert wrapped and all(isinstance(m.base, GGUFLinear) for m in wrapped)
    logits = mixed_prefill(runner, ["sql", "", "all"])
    for row, name in enumerate(["sql", "", "all"]):
        ref = hf_last_logits(peft_model(path, lora_adapters.get(name)), PROMPTS[name])
        # fp32 block GEMVs sum in another order than torch: ~1e-4 on logits of ~20
        assert (logits[row] - ref).abs().max().item() < 3e-4, name


def test_cpu_paths_match_the_reference_over_ranks_and_segments() -> None:
    torch.manual_seed(0)
    ranks = [3, 0, 8]  # slot 1 leaves this projection alone
    adapters = [
        (torch.randn(r, 24), torch.randn(40, r), 0.5 * (i + 1)) for i, r in enumerate(ranks)
    ]
    w = LoraWeights.stack(adapters, rank=8)
    x = torch.randn(11, 24)
    batch = LoraBatch.from_seqs([4, 2, 3, 2], [2, BASE, 0, 1])
    ref = torch.zeros(11, 40)
    lora_apply_torch(x, ref, w, batch)
    # rank-major weights with the scaling folded into b, as the worker keeps them
    a = w.a.permute(1, 0, 2).contiguous()  # [R, n, K]
    b = (w.b * w.scalings[:, None, None]).permute(2, 0, 1).contiguous()  # [R, n, N]
    segments = [(2, 0, 4), (0, 6, 9), (1, 9, 11)]
    got = torch.zeros(11, 40)
    lora_apply_segments(x, got, a, b, segments, ranks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # gathered: rows by slot (0: 6..9, 1: 9..11, 2: 0..4), padded to 4 rows a slot
    x_grouped = torch.cat([x[6:9], x[9:11], x[0:4]])
    order = list(range(6, 9)) + list(range(9, 11)) + list(range(0, 4))
    xg = torch.stack([torch.cat([x[6:9], x[6:7]]), torch.cat([x[9:11], x[6:8]]), x[0:4]])
    valid = torch.tensor([0, 1, 2, 4, 5, 8, 9, 10, 11])
    out = torch.zeros(9, 40)
    lora_apply_gathered(xg, out, a.permute(1, 2, 0), b.permute(1, 0, 2), valid)
    torch.testing.assert_close(out, ref[order], rtol=1e-5, atol=1e-5)
    assert x_grouped.shape[0] == 9 and out[3:5].abs().max().item() == 0  # rank 0: untouched


def test_plan_merges_runs_of_one_slot_and_gathers_balanced_ones() -> None:
    ranks = {"q_proj": [4, 0, 0, 8], "v_proj": [0, 0, 0, 0]}
    plan = LoraPlan.build([5, 1, 1, 2, 1], [BASE, 0, 0, 3, 3], ranks)
    assert plan.batch.seg_indptr.tolist() == [0, 5, 7, 10]
    assert plan.batch.seg_adapter.tolist() == [BASE, 0, 3]
    assert plan.segments == [(0, 5, 7), (3, 7, 10)]
    assert plan.ranks == {"q_proj": 8}  # v_proj: no slot of the step adapts it
    g = plan.gather  # slots 0..3 of 3 rows: 12 computed for 5 needed, over MAX_PADDING
    assert g is None
    plan = LoraPlan.build([1, 1, 2, 1], [0, 0, 1, 1], ranks)
    g = plan.gather
    assert g is not None and g.first == 0 and g.slots == slice(0, 2) and g.rows == 3
    assert g.index.tolist() == [0, 1, 0, 2, 3, 4] and g.valid.tolist() == [0, 1, 3, 4, 5]
