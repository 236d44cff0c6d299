"""Reading a PEFT LoRA adapter folder and checking it against the base model.

A PEFT adapter is ``adapter_config.json`` beside ``adapter_model.safetensors``
(``adapter_model.bin`` is a pickle: refused, since loading one runs code). The
safetensors file is read here with numpy alone (its format is an 8-byte header
length, a JSON header and raw little-endian tensors; bfloat16 is widened by bit
shifting), so the loader process needs no torch.

What comes out (:class:`AdapterWeights`) is what the worker computes with: for
each projection the adapter targets, ``a`` [L, r, in] and ``b`` [L, out, r] float32
with the scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded into
``b``, zero in the layers it leaves alone, ``r`` the largest rank any layer uses
(per-module ranks from ``rank_pattern`` are zero-padded, which changes nothing).

Every refusal is an :class:`AdapterError` whose message names the adapter and says
what is wrong and what would be right. Pure Python and numpy: no asyncio, zmq or torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...gpu.lora.targets import LORA_MODULES, BaseShapes

__all__ = ["AdapterError", "AdapterWeights", "read_adapter", "read_safetensors"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 64 * 2**20

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(" + "|".join(LORA_MODULES) + r")\.lora_([AB])\.weight$"
)
_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "bf16"}
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
# adapter_config.json settings that change the math this engine computes: refused
# unless left at PEFT's default (the rest are training-time settings, ignored).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layer_replication": (None, []),
    "alpha_pattern": (None, {}),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why (a client's 400)."""


@dataclass
class AdapterWeights:
    name: str
    path: str
    lora_id: str
    rank: int  # the largest rank of any target
    targets: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return [m for m in LORA_MODULES if m in self.targets]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.targets.values())


def read_adapter(name: str, path: str, shapes: BaseShapes, max_rank: int) -> AdapterWeights:
    """Read and check the PEFT adapter at ``path`` (blocking: run it off the loop)."""
    folder = Path(path)
    where = f"adapter {name!r} ({path})"
    if not folder.exists():
        raise AdapterError(f"{where}: no such directory")
    if not folder.is_dir():
        raise AdapterError(f"{where}: not a directory; give the folder PEFT saved the adapter in")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing")
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").exists():
            raise AdapterError(
                f"{where}: adapter_model.bin is a pickle, which is refused (loading one runs "
                f"code); save the adapter with safe_serialization=True for {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is missing")
    config_bytes = _read(config_path, where)
    weights_bytes = _read(weights_path, where)
    try:
        config = json.loads(config_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    r, alpha, rslora = _check_config(config, where)
    try:
        tensors = read_safetensors(weights_bytes)
    except ValueError as exc:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is corrupt: {exc}") from None
    digest = hashlib.sha256(f"{name}\0".encode() + config_bytes + b"\0" + weights_bytes)
    pairs = _pairs(tensors, shapes, where)
    _check_targets(config, pairs, shapes.num_layers, where)
    has_pattern = bool(config.get("rank_pattern"))
    out = AdapterWeights(name, str(folder.resolve()), digest.hexdigest()[:24], 0)
    for module in LORA_MODULES:
        layers = {i: ab for (i, m), ab in pairs.items() if m == module}
        if not layers:
            continue
        k, n = shapes.modules[module]
        rank = 0
        for i, (a, b) in layers.items():
            label = f"layer {i} {module}"
            if a.ndim != 2 or a.shape[1] != k:
                raise AdapterError(
                    f"{where}: {label}.lora_A has shape {list(a.shape)}, the base model needs "
                    f"[rank, {k}]: the adapter was trained for another model"
                )
            if b.ndim != 2 or b.shape[0] != n or b.shape[1] != a.shape[0]:
                raise AdapterError(
                    f"{where}: {label}.lora_B has shape {list(b.shape)}, the base model and "
                    f"lora_A need [{n}, {a.shape[0]}]: the adapter was trained for another model"
                )
            ri = a.shape[0]
            if ri < 1:
                raise AdapterError(f"{where}: {label} has rank 0")
            if not has_pattern and ri != r:
                raise AdapterError(f"{where}: {label} has rank {ri}, {CONFIG_FILE} says r={r}")
            if ri > max_rank:
                raise AdapterError(
                    f"{where}: rank {ri} ({label}) is more than --max-lora-rank {max_rank}"
                )
            rank = max(rank, ri)
        a_all = np.zeros((shapes.num_layers, rank, k), np.float32)
        b_all = np.zeros((shapes.num_layers, n, rank), np.float32)
        for i, (a, b) in layers.items():
            ri = a.shape[0]
            scaling = alpha / (math.sqrt(ri) if rslora else ri)
            a_all[i, :ri] = a
            b_all[i, :, :ri] = b * np.float32(scaling)
        if not (np.isfinite(a_all).all() and np.isfinite(b_all).all()):
            raise AdapterError(f"{where}: {module} holds inf or NaN weights")
        out.targets[module] = (a_all, b_all)
        out.rank = max(out.rank, rank)
    return out


def _read(path: Path, where: str) -> bytes:
    if not path.is_file():  # a FIFO or a device would block the reading thread for good
        raise AdapterError(f"{where}: {path.name} is not a regular file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"{where}: cannot read {path.name}: {exc.strerror}") from None


def _check_config(config: dict[str, Any], where: str) -> tuple[int, float, bool]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not served; only LORA is")
    for key, defaults in _UNSUPPORTED.items():
        if key in config and config[key] not in defaults:
            raise AdapterError(
                f"{where}: {CONFIG_FILE} sets {key}={config[key]!r}, which this server does "
                "not serve (plain LoRA on q/k/v/o/gate/up/down_proj only)"
            )
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: {CONFIG_FILE} needs r, a positive integer (got {r!r})")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: {CONFIG_FILE} needs lora_alpha, a number (got {alpha!r})")
    return r, float(alpha), bool(config.get("use_rslora", False))


def _check_targets(
    config: dict[str, Any], pairs: dict[tuple[int, str], Any], num_layers: int, where: str
) -> None:
    """The weights are those the config says it trained, as PEFT would load them: no
    module outside a list of ``target_modules`` (a regex or "all-linear" names no list
    to hold them to), no layer outside ``layers_to_transform``, which must name layers
    the model has (PEFT refuses such an adapter; applied, it would not be that adapter)."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        named = {str(t).rsplit(".", 1)[-1] for t in targets}
        extra = sorted({m for _, m in pairs} - named)
        if extra:
            raise AdapterError(
                f"{where}: {WEIGHTS_FILE} holds weights for {', '.join(extra)}, which "
                f"{CONFIG_FILE}'s target_modules does not name"
            )
    layers = config.get("layers_to_transform")
    if layers is None:
        return
    wanted = (
        {layers} if isinstance(layers, int) else set(layers) if isinstance(layers, list) else None
    )
    if wanted is None or not all(isinstance(i, int) and 0 <= i < num_layers for i in wanted):
        raise AdapterError(
            f"{where}: layers_to_transform {layers!r} names layers the base model lacks "
            f"(it has {num_layers})"
        )
    extra_layers = sorted({i for i, _ in pairs} - wanted)
    if extra_layers:
        raise AdapterError(
            f"{where}: {WEIGHTS_FILE} holds weights for layers {extra_layers}, outside "
            f"layers_to_transform {sorted(wanted)}"
        )


def _pairs(
    tensors: dict[str, np.ndarray], shapes: BaseShapes, where: str
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) → (lora_A, lora_B), every tensor name accounted for."""
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{where}: tensor {key!r} is not served: only lora_A/lora_B of "
                f"{', '.join(LORA_MODULES)} in the decoder layers are (no embedding, "
                "lm_head or modules_to_save)"
            )
        layer, module, half = int(m[1]), m[2], m[3]
        if layer >= shapes.num_layers:
            raise AdapterError(
                f"{where}: tensor {key!r} is for layer {layer}; the base model has "
                f"{shapes.num_layers} layers"
            )
        halves.setdefault((layer, module), {})[half] = arr
    if not halves:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    out = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{where}: layer {layer} {module} has no {missing}")
        out[layer, module] = (ab["A"], ab["B"])
    return out


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """name → float32 array, from a safetensors file's bytes; ValueError if malformed."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes is too short for a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"header length {n} does not fit the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    body = memoryview(data)[8 + n :]
    out: dict[str, np.ndarray] = {}
    spans = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
            count = math.prod(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed entry") from None
        if dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} is {dtype}; LoRA weights must be F32, F16 or BF16")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= len(body)):
            raise ValueError(f"tensor {name!r} lies outside the file (truncated?)")
        if hi - lo != count * _ITEMSIZE[dtype] or any(int(s) < 0 for s in shape):
            raise ValueError(f"tensor {name!r}: {hi - lo} bytes for shape {shape} of {dtype}")
        spans.append((lo, hi, name))
        raw = body[lo:hi]
        if dtype == "BF16":
            wide = np.frombuffer(raw, "<u2").astype("<u4") << 16
            arr = wide.view("<f4")
        else:
            arr = np.frombuffer(raw, _DTYPES[dtype]).astype(np.float32)
        out[name] = arr.reshape([int(s) for s in shape])
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ValueError(f"tensors {first!r} and {second!r} overlap")
    return out
