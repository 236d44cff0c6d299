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

Other top-level tables ([scheduler], [cache], [server], [router], [deploy]) set the
same fields as the CLI flags. Data-parallel replicas (``[router] dp_size = 2``) name
their members' tables ``[actors.scheduler.1]`` (TOML nests them; they are read as the
role ``scheduler.1``), and so on for ``cache_manager.1`` and ``worker.1``; prefill
replicas (``[router] prefill_replicas = 1``) are numbered after them.
"""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .config import (
    DEFAULT_MAX_LORA_RANK,
    CacheConfig,
    DeployConfig,
    EngineConfig,
    GrammarConfig,
    LoraConfig,
    ModelConfig,
    RouterConfig,
    SchedulerConfig,
    ServerConfig,
)

if TYPE_CHECKING:
    from .gpu.model_info import ModelInfo

__all__ = [
    "ConfigError",
    "Deployment",
    "config_from_options",
    "load_deployment",
    "resolve_config",
    "validate_config",
]


class ConfigError(TypeError, ValueError):
    """A setting that cannot work; the message says which and what would."""


# Settings with a fixed set of values (those chosen from a registry are checked by name).
_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("scheduler", "policy"): ("fcfs", "lpm", "priority"),
    ("scheduler", "on_worker_loss"): ("fail", "recompute"),
    ("deploy", "transport"): ("unix", "ipc", "tcp"),
    ("deploy", "restart_policy"): ("on-failure", "never"),
    ("deploy", "launcher"): ("local", "ray"),
}

_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "lora": LoraConfig,
    "server": ServerConfig,
    "grammar": GrammarConfig,
    "router": RouterConfig,
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
        if key in ("plugins", "plugin_config"):  # {name: {key: value}}, merged per plugin
            merged = {n: dict(v) for n, v in config.plugins.items()}
            for name, values in dict(value).items():
                merged.setdefault(name, {}).update(values)
            config = msgspec.structs.replace(config, plugins=merged)
            continue
        owner = owners.get(key)
        if owner is None:
            raise ConfigError(f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}")
        updates.setdefault(owner, {})[key] = value
    for section, values in updates.items():
        config = msgspec.structs.replace(config, **{section: _merged(config, section, values)})
    return config


def _merged(config: EngineConfig, section: str, values: dict[str, Any]) -> msgspec.Struct:
    current = getattr(config, section)
    try:
        return msgspec.convert({**msgspec.to_builtins(current), **values}, type(current))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"[{section}] {exc}") from None


def validate_config(config: EngineConfig) -> None:
    """Refuse, in one clear line, settings that cannot work, before any actor starts.
    (Names from registries that only the worker loads, like quantization methods, are
    checked there.)"""
    from .extensions.points import (
        ATTENTION_BACKENDS,
        EVICTION_POLICIES,
        HICACHE_STORAGE,
        WEIGHT_LOADERS,
    )

    if config.deploy.transport == "inproc":  # accepted before, then no actor could connect
        raise ConfigError(
            "--transport 'inproc' joins actors inside one process, and each actor runs in its "
            "own: choose unix (the default), ipc or tcp; Engine(placement='inproc') runs every "
            "actor in the caller's process"
        )
    for (section, name), allowed in _CHOICES.items():
        value = getattr(getattr(config, section), name)
        if value not in allowed:
            raise ConfigError(
                f"--{name.replace('_', '-')} {value!r}: choose one of {', '.join(allowed)}"
            )
    import actorlm.actors.cache.eviction  # noqa: F401  (register the built-ins, lazily)
    import actorlm.actors.cache.hicache  # noqa: F401
    import actorlm.gpu.attention  # noqa: F401
    import actorlm.gpu.loaders  # noqa: F401

    m, c = config.model, config.cache
    for registry, value in (
        (ATTENTION_BACKENDS, m.attention_backend),
        (WEIGHT_LOADERS, "" if m.load_format == "auto" else m.load_format),
        (EVICTION_POLICIES, c.eviction_policy),
        (HICACHE_STORAGE, c.hicache_storage_backend),
    ):
        if value and value not in registry:
            known = ", ".join(registry.names()) or "none"
            raise ConfigError(
                f"unknown {registry.kind} {value!r} ({registry.flag}); known: {known}"
            )
    if c.hicache_storage_backend and not c.hicache_storage_dir:
        raise ConfigError("--hicache-storage-backend needs --hicache-storage-dir")
    d = config.deploy
    if d.launcher == "ray" and importlib.util.find_spec("ray") is None:
        from .actors.runtime.ray_launcher import RAY_MISSING

        raise ConfigError(RAY_MISSING)
    if d.launcher == "ray" and min(d.ray_worker_cpus, d.ray_actor_cpus) < 0:
        raise ConfigError("--ray-worker-cpus and --ray-actor-cpus cannot be negative")
    _validate_grammar(config)


def _validate_grammar(config: EngineConfig) -> None:
    import actorlm.actors.tokenizer.reasoning  # noqa: F401  (register the built-ins)
    import actorlm.gpu.grammar  # noqa: F401  (lazily: no grammar library is imported)

    from .extensions.points import GRAMMAR_BACKENDS, REASONING_PARSERS

    g = config.grammar
    for flag, value, extra in (
        ("--grammar-backend", g.grammar_backend, ("none",)),
        ("--grammar-fallback", g.grammar_fallback, ("auto", "none")),
    ):
        if value not in extra and value not in GRAMMAR_BACKENDS:
            known = ", ".join([*extra, *GRAMMAR_BACKENDS.names()])
            raise ConfigError(f"unknown grammar backend {value!r} ({flag}); known: {known}")
    if g.reasoning_parser and g.reasoning_parser not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSERS.names()) or "none"
        raise ConfigError(
            f"unknown reasoning parser {g.reasoning_parser!r} (--reasoning-parser); known: {known}"
        )
    if not g.grammar_compile_timeout_s > 0 or g.grammar_compile_threads < 1:
        raise ConfigError(
            "--grammar-compile-timeout must be > 0 and --grammar-compile-threads >= 1"
        )

    _validate_lora(config.lora)
    _validate_router(config)


def _validate_router(config: EngineConfig) -> None:
    import actorlm.actors.router.policies  # noqa: F401  (registers the built-ins)

    from .actors.replicas import parse_cpus
    from .extensions.points import ROUTER_POLICIES

    r = config.router
    if r.dp_size < 1:
        raise ConfigError(f"--dp-size {r.dp_size} is out of range (1 or more)")
    if r.router_policy and r.router_policy not in ROUTER_POLICIES:
        known = ", ".join(ROUTER_POLICIES.names())
        raise ConfigError(
            f"unknown router policy {r.router_policy!r} (--router-policy); known: {known}"
        )
    if not 0.0 <= r.router_cache_threshold <= 1.0 or r.router_balance_abs < 0:
        raise ConfigError("--router-cache-threshold must be in [0, 1], --router-balance-abs >= 0")
    if r.router_balance_rel < 1.0:
        raise ConfigError(f"--router-balance-rel {r.router_balance_rel} must be >= 1")
    if (r.dp_size > 1 or r.prefill_replicas) and config.lora.enabled:
        raise ConfigError(
            "--dp-size > 1 (or --prefill-replicas) does not serve LoRA adapters yet "
            "(one lora_loader per worker)"
        )
    if min(r.prefill_replicas, r.max_local_prefill_tokens, r.max_prefill_queue) < 0:
        raise ConfigError(
            "--prefill-replicas, --max-local-prefill-tokens and --max-prefill-queue must be >= 0"
        )
    if not r.kv_transfer_timeout_s > 0:
        raise ConfigError("--kv-transfer-timeout-s must be > 0")
    cpus = config.deploy.worker_cpus
    replicas = r.dp_size + r.prefill_replicas
    if cpus and len(cpus) != replicas:
        raise ConfigError(
            f"--worker-cpus names {len(cpus)} CPU sets for {replicas} replica(s) "
            "(--dp-size plus --prefill-replicas): give one per replica"
        )
    for spec in cpus:
        try:
            parse_cpus(spec)
        except ValueError as exc:
            raise ConfigError(f"--worker-cpus: {exc}") from None


def _validate_lora(lora: LoraConfig) -> None:
    import actorlm.actors.lora_loader.eviction  # noqa: F401  (registers the built-ins)

    from .actors.lora_loader.registry import parse_lora_spec
    from .extensions.points import LORA_EVICTION_POLICIES

    if lora.lora_eviction_policy not in LORA_EVICTION_POLICIES:
        known = ", ".join(LORA_EVICTION_POLICIES.names())
        raise ConfigError(
            f"unknown LoRA eviction policy {lora.lora_eviction_policy!r} "
            f"(--lora-eviction-policy); known: {known}"
        )
    for name, value in (
        ("max_loras_per_batch", lora.max_loras_per_batch),
        ("max_loaded_loras", lora.max_loaded_loras),
        ("max_lora_rank", lora.max_lora_rank),
    ):
        if value < (1 if name == "max_loras_per_batch" else 0):
            raise ConfigError(f"--{name.replace('_', '-')} {value} is out of range")
    if lora.max_loaded_loras and len(lora.lora_paths) > lora.max_loaded_loras:
        raise ConfigError(
            f"--lora-paths names {len(lora.lora_paths)} adapters, more than "
            f"--max-loaded-loras {lora.max_loaded_loras}"
        )
    names = set()
    for spec in lora.lora_paths:
        try:
            name, path, _ = parse_lora_spec(spec)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if name in names:
            raise ConfigError(f"--lora-paths names the adapter {name!r} twice")
        names.add(name)
        if not (Path(path) / "adapter_config.json").is_file():
            raise ConfigError(f"--lora-paths {spec}: {path} holds no adapter_config.json")


def _lora_rank(lora: LoraConfig) -> int:
    """--max-lora-rank, else the largest rank (r, or in rank_pattern) of --lora-paths."""
    from .actors.lora_loader.registry import parse_lora_spec

    if lora.max_lora_rank:
        return lora.max_lora_rank
    ranks = []
    for spec in lora.lora_paths:
        path = Path(parse_lora_spec(spec)[1]) / "adapter_config.json"
        try:
            cfg = json.loads(path.read_text())
            ranks += [int(cfg.get("r") or 0), *map(int, (cfg.get("rank_pattern") or {}).values())]
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(f"--lora-paths {spec}: cannot read {path}: {exc}") from None
    return max(ranks, default=0) or DEFAULT_MAX_LORA_RANK


def _read_start_adapters(lora: LoraConfig, info: ModelInfo, served: str) -> None:
    """Read every --lora-paths adapter as the lora_loader will, so that one it would
    refuse (broken weights, modules the model lacks, a rank over the slots') stops the
    start with its reason, as vLLM's does, rather than serving without it."""
    from .actors.lora_loader.peft import AdapterError, read_adapter
    from .actors.lora_loader.registry import parse_lora_spec
    from .gateway.state import DEFAULT_ALIAS
    from .gpu.lora.targets import BaseShapes

    shapes = BaseShapes.from_info(info)
    pinned = 0
    for spec in lora.lora_paths:
        name, path, pin = parse_lora_spec(spec)
        if name in (served, DEFAULT_ALIAS):
            raise ConfigError(f"--lora-paths {spec}: {name!r} names the base model")
        pinned += pin
        if pin and pinned >= lora.max_loras_per_batch:  # as the lora_loader's registry
            raise ConfigError(
                f"--lora-paths pins {pinned} adapters, which leaves none of the "
                f"--max-loras-per-batch {lora.max_loras_per_batch} slots to the others"
            )
        try:
            read_adapter(name, path, shapes, lora.max_lora_rank)
        except AdapterError as exc:
            raise ConfigError(f"--lora-paths {spec}: {exc}") from None


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Fill platform defaults, then model path, context length, KV page count and
    served name from the model."""
    from .extensions.plugins import load_plugins
    from .gpu.default_model import default_model_path
    from .gpu.model_info import kv_pages_for_budget, load_model_info
    from .gpu.platforms import device_platform

    # The platform fills what the user left open (device, dtype, attention backend, page
    # size), and refuses what it cannot run before any actor starts.
    load_plugins(settings=config.plugins)  # once per process; the first call's settings hold
    platform = device_platform(config.model.device)  # --device cpu on a GPU machine: the CPU's
    config = platform.adjust_defaults(config)
    validate_config(config)
    try:
        platform.check_config(config)
    except ValueError as exc:  # what this machine cannot run: the user's to change
        raise ConfigError(str(exc)) from None
    m = config.model
    path = m.path or str(default_model_path())
    if not Path(path).exists():
        raise ConfigError(f"model not found: {path}")
    info = load_model_info(path)
    from .gpu.models import resolve_model_impl

    try:
        resolve_model_impl(info.architecture, m.model_impl, info.native_gaps)  # fails here
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    max_len = m.max_model_len or info.max_model_len
    num_pages = m.num_pages or kv_pages_for_budget(
        info, platform.kv_cache_bytes(m, info), m.page_size, m.dtype
    )
    name = m.served_model_name or Path(path).name.removesuffix(".gguf")
    if config.lora.enabled:
        lora = msgspec.structs.replace(config.lora, max_lora_rank=_lora_rank(config.lora))
        config = msgspec.structs.replace(config, lora=lora)
        _read_start_adapters(lora, info, name)
    model = msgspec.structs.replace(
        m,
        path=str(Path(path).resolve()),
        max_model_len=max_len,
        vocab_size=m.vocab_size or info.vocab_size,
        num_pages=num_pages,
        served_model_name=name,
    )
    return msgspec.structs.replace(config, model=model)


def _flat_replicas(actors: Any) -> Any:
    """``{"scheduler": {"address": a, "1": {"address": b}}}`` (what TOML makes of
    ``[actors.scheduler.1]``) → ``{"scheduler": {...}, "scheduler.1": {...}}``."""
    if not isinstance(actors, dict):
        return actors
    flat: dict[str, Any] = {}
    for role, spec in actors.items():
        if isinstance(spec, dict):
            nested = {k: v for k, v in spec.items() if k.isdigit() and isinstance(v, dict)}
            for index, sub in nested.items():
                flat[f"{role}.{index}"] = sub
            spec = {k: v for k, v in spec.items() if k not in nested}
            if not spec and nested:
                continue  # only replicas of it are placed here
        flat[role] = spec
    return flat


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    config: EngineConfig
    addresses: dict[str, str]  # role → address peers use
    binds: dict[str, str]  # role → address the actor binds (defaults to its address)


def load_deployment(path: str | Path, base: EngineConfig | None = None) -> Deployment:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the deployment file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    actors = _flat_replicas(data.pop("actors", {}))
    config = base or EngineConfig()
    plugins = data.pop("plugins", {})
    if not isinstance(plugins, dict) or not all(isinstance(v, dict) for v in plugins.values()):
        raise ConfigError(f"{path}: [plugins.NAME] tables hold each plugin's settings")
    if plugins:
        config = config_from_options(config, plugins=plugins)
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{path}: unknown section [{section}]; known: actors, plugins, {', '.join(_SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [{section}] must be a table")
        config = msgspec.structs.replace(config, **{section: _merged(config, section, values)})
    bad = [r for r, spec in actors.items() if not isinstance(spec, dict) or "address" not in spec]
    if bad:
        raise ConfigError(f'{path}: [actors.{bad[0]}] needs an address = "tcp://host:port"')
    addresses = {role: str(spec["address"]) for role, spec in actors.items()}
    binds = {role: str(spec.get("bind", spec["address"])) for role, spec in actors.items()}
    deploy = msgspec.structs.replace(config.deploy, addresses=addresses, transport="tcp")
    return Deployment(
        config=msgspec.structs.replace(config, deploy=deploy), addresses=addresses, binds=binds
    )
