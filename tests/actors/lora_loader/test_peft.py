"""Reading PEFT adapters: what comes out is PEFT's own delta for every module and layer,
and every kind of broken adapter is refused with a message that says what is wrong."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from actorlm.actors.lora_loader.peft import AdapterError, read_adapter, read_safetensors
from actorlm.gpu.lora.targets import BaseShapes
from actorlm.gpu.model_info import load_model_info


@pytest.fixture(scope="module")
def shapes(tiny_llama: Path) -> BaseShapes:
    return BaseShapes.from_info(load_model_info(tiny_llama))


def peft_deltas(base: Path, adapter: Path) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) → ``peft``'s own delta weight (B A times its scaling)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, str(adapter))
    out = {}
    for name, module in peft.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            layer = int(name.split("layers.")[1].split(".")[0])
            out[layer, name.rsplit(".", 1)[1]] = module.get_delta_weight("default").detach()
    return out


@pytest.mark.parametrize("name", ["sql", "chat", "all", "sparse"])
def test_weights_are_peft_deltas(
    name: str, tiny_llama: Path, lora_adapters: dict[str, Path], shapes: BaseShapes
) -> None:
    w = read_adapter(name, str(lora_adapters[name]), shapes, max_rank=16)
    want = peft_deltas(tiny_llama, lora_adapters[name])
    assert set(w.target_modules) == {m for _, m in want}
    for module, (a, b) in w.targets.items():
        for layer in range(shapes.num_layers):
            got = torch.from_numpy(b[layer] @ a[layer])  # scaling folded into b
            ref = want.get((layer, module), torch.zeros_like(got))
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert w.rank == {"sql": 4, "chat": 8, "all": 16, "sparse": 6}[name]
    assert len(w.lora_id) == 24
    again = read_adapter(name, str(lora_adapters[name]), shapes, max_rank=16)
    assert again.lora_id == w.lora_id  # the same name and bytes: the same id
    assert read_adapter("other", str(lora_adapters[name]), shapes, 16).lora_id != w.lora_id


def test_bfloat16_and_float16_files_read_as_their_values(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    t = torch.randn(3, 5)
    save_file({"b": t.bfloat16(), "h": t.half()}, str(tmp_path / "x.safetensors"))
    got = read_safetensors((tmp_path / "x.safetensors").read_bytes())
    assert np.array_equal(got["b"], t.bfloat16().float().numpy())
    assert np.array_equal(got["h"], t.half().float().numpy())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> Path:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def _broken(kind: str, good: Path, tmp: Path, other_base: Path) -> Path:
    """A broken copy of the adapter ``good``."""
    bad = tmp / kind
    if kind == "missing":
        return bad
    if kind == "not_a_directory":
        bad.write_text("an adapter is a folder")
        return bad
    _copy(good if kind != "wrong_shapes" else other_base, bad)
    weights = bad / "adapter_model.safetensors"
    if kind == "no_config":
        (bad / "adapter_config.json").unlink()
    elif kind == "bad_json":
        (bad / "adapter_config.json").write_text("{not json")
    elif kind == "no_weights":
        weights.unlink()
    elif kind == "pickle":
        weights.rename(bad / "adapter_model.bin")
    elif kind == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif kind == "bad_header":
        data = weights.read_bytes()
        weights.write_bytes(struct.pack("<Q", 10**6) + data[8:])
    elif kind == "dora":
        _edit_config(bad, use_dora=True)
    elif kind == "not_lora":
        _edit_config(bad, peft_type="IA3")
    elif kind == "fewer_targets":  # the weights hold q, v and down_proj
        _edit_config(bad, target_modules=["q_proj"])
    elif kind == "far_layer":  # the model has 2
        _edit_config(bad, layers_to_transform=[5])
    elif kind == "outside_layers":  # the weights hold both
        _edit_config(bad, layers_to_transform=[1])
    return bad


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("missing", "no such directory"),
        ("not_a_directory", "not a directory"),
        ("no_config", "adapter_config.json is missing"),
        ("bad_json", "not valid JSON"),
        ("no_weights", "adapter_model.safetensors is missing"),
        ("pickle", "adapter_model.bin is a pickle, which is refused"),
        ("truncated", "corrupt: tensor"),
        ("bad_header", "corrupt: header length"),
        ("dora", "use_dora=True"),
        ("not_lora", "peft_type 'IA3'"),
        ("wrong_shapes", "trained for another model"),
        ("fewer_targets", "weights for down_proj, v_proj, which"),
        ("far_layer", "layers_to_transform [5] names layers the base model lacks"),
        ("outside_layers", "weights for layers [0], outside layers_to_transform [1]"),
    ],
)
def test_broken_adapters_are_refused_with_the_reason(
    kind: str,
    says: str,
    lora_adapters: dict[str, Path],
    shapes: BaseShapes,
    tmp_path: Path,
    wide_adapter: Path,
) -> None:
    bad = _broken(kind, lora_adapters["sql"], tmp_path, wide_adapter)
    with pytest.raises(AdapterError, match="adapter 'x'") as info:
        read_adapter("x", str(bad), shapes, max_rank=16)
    assert says in str(info.value)


@pytest.fixture(scope="module")
def wide_adapter(tiny_model_factory: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter for a model of another width (hidden 96): wrong shapes for tiny_llama."""
    from tests.models import build_lora_adapter

    base = tiny_model_factory("llama", hidden_size=96)  # type: ignore[operator]
    return build_lora_adapter(base, tmp_path_factory.mktemp("wide") / "a", r=4)


def test_rank_above_the_limit_and_unserved_modules(
    lora_adapters: dict[str, Path], shapes: BaseShapes, tiny_llama: Path, tmp_path: Path
) -> None:
    with pytest.raises(AdapterError, match="rank 16 .* is more than --max-lora-rank 8"):
        read_adapter("x", str(lora_adapters["all"]), shapes, max_rank=8)
    from tests.models import build_lora_adapter

    head = build_lora_adapter(tiny_llama, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(AdapterError, match="lm_head.* is not served"):
        read_adapter("x", str(head), shapes, max_rank=16)
