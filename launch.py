"""Turning options into one resolved, frozen config, and deployment files.

``resolve_config`` fills what can only be known from the model file (context
length, KV pages for the memory budget, the served name) before any actor
starts, so every actor sees the same numbers.

A deployment file (TOML) places each actor for a disaggregated start::

    [model]
    path = "/models/smollm2.gguf"

    [actors.tokenizer]
    address = "tcp://10.0.0.1:7001"       # where peers reach it
    bind = "tcp://0.0.0.0:7001"           # optional: what it binds
    [actors.scheduler]
    address = "tcp://10.0.0.2:7002"
    # ... cache_manager, worker

Other top-level tables ([scheduler], [cache], [server], [deploy]) set the
same fields as the CLI flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import tomllib

from .config import (
    CacheConfig,
    DeployConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

__all__ = ["Deployment", "config_from_options", "load_deployment", "resolve_config"]

_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "server": ServerConfig,
    "deploy": DeployConfig,
}


def config_from_options(base: EngineConfig | None = None, **options: Any) -> EngineConfig:
    """Set fields by their plain names (``page_size=32``, ``policy="lpm"``) in whichever
    section has them; unknown names raise with the list of known ones."""
    config = base or EngineConfig()
    updates: dict[str, dict[str, Any]] = {}
    owners: dict[str, str] = {}
    for section, cls in _SECTIONS.items():
        for f in msgspec.structs.fields(cls):
            owners.setdefault(f.name, section)
    for key, value in options.items():
        if key == "log_level":
            config = msgspec.structs.replace(config, log_level=value)
            continue
        section = owners.get(key)
        if section is None:
            raise TypeError(f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}")
        updates.setdefault(section, {})[key] = value
    for section, values in updates.items():
        current = getattr(config, section)
        merged = msgspec.convert({**msgspec.to_builtins(current), **values}, type(current))
        config = msgspec.structs.replace(config, **{section: merged})
    return config


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Fill platform defaults, then model path, context length, KV page count and
    served name from the model."""
    from .extensions.plugins import current_platform
    from .gpu.default_model import default_model_path
    from .gpu.model_info import kv_pages_for_budget, load_model_info

    # The platform fills what the user left open (device, attention backend, page size).
    config = current_platform().adjust_defaults(config)
    m = config.model
    path = m.path or str(default_model_path())
    if not Path(path).exists():
        raise FileNotFoundError(f"model not found: {path}")
    info = load_model_info(path)
    from .gpu.models import resolve_model_impl

    resolve_model_impl(info.architecture, m.model_impl)  # an unknown one fails here, in one line
    max_len = m.max_model_len or info.max_model_len
    num_pages = m.num_pages or kv_pages_for_budget(
        info, m.kv_cache_gb * 2**30, m.page_size, m.dtype
    )
    name = m.served_model_name or Path(path).name.removesuffix(".gguf")
    model = msgspec.structs.replace(
        m,
        path=str(Path(path).resolve()),
        max_model_len=max_len,
        num_pages=num_pages,
        served_model_name=name,
    )
    return msgspec.structs.replace(config, model=model)


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    config: EngineConfig
    addresses: dict[str, str]  # role → address peers use
    binds: dict[str, str]  # role → address the actor binds (defaults to its address)


def load_deployment(path: str | Path, base: EngineConfig | None = None) -> Deployment:
    data = tomllib.loads(Path(path).read_text())
    actors = data.pop("actors", {})
    config = base or EngineConfig()
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ValueError(
                f"{path}: unknown section [{section}]; known: actors, {', '.join(_SECTIONS)}"
            )
        current = getattr(config, section)
        merged = msgspec.convert({**msgspec.to_builtins(current), **values}, type(current))
        config = msgspec.structs.replace(config, **{section: merged})
    addresses = {role: str(spec["address"]) for role, spec in actors.items()}
    binds = {role: str(spec.get("bind", spec["address"])) for role, spec in actors.items()}
    deploy = msgspec.structs.replace(config.deploy, addresses=addresses, transport="tcp")
    return Deployment(
        config=msgspec.structs.replace(config, deploy=deploy), addresses=addresses, binds=binds
    )
