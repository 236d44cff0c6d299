"""One frozen configuration tree, built once (CLI, Engine kwargs or a deployment
file) and passed to every actor. Nothing reads the environment except
``extensions.plugins``; nothing mutates this after start-up."""

from __future__ import annotations

import msgspec

__all__ = [
    "DEFAULT_MAX_PREFILL_TOKENS",
    "CacheConfig",
    "DeployConfig",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "ServerConfig",
]


# The per-step prefill budget where neither the user nor a platform chose one.
DEFAULT_MAX_PREFILL_TOKENS = 2048


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str = ""  # HF folder or .gguf file; "" = the embedded default model
    load_format: str = "auto"  # auto | safetensors | layered | gguf | a plugin's name
    dtype: str = "auto"  # auto (the platform's: bf16 on CPUs with native bf16) | float32 | bfloat16
    device: str = ""  # "" = the active platform's device
    attention_backend: str = ""  # "" = the platform's default
    quantization: str = ""  # none | fp16 | a plugin's; "" = the platform's default
    page_size: int = 16
    kv_cache_gb: float = 1.0  # memory budget for the paged KV pool
    num_pages: int = 0  # 0 = derive from kv_cache_gb
    max_model_len: int = 0  # 0 = from the model's config
    num_threads: int = 0  # torch threads in the worker; 0 = all cores
    fused_decode_max_batch: int = (
        8  # CPU: decode steps up to this batch as one native call; 0 = off
    )
    served_model_name: str = ""
    seed: int = 0


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    policy: str = "fcfs"  # fcfs | lpm | priority
    max_running_requests: int = 64
    max_prefill_tokens: int = 0  # per-step token budget (chunked prefill); 0 = the platform's
    max_queued_requests: int = 1024
    step_timeout_s: float = 300.0


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    enable_prefix_cache: bool = True
    eviction_policy: str = "lru"
    hicache_storage_backend: str = ""  # "" = off; "file" built in
    hicache_storage_dir: str = ""


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 5.0


class DeployConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where actors live. ``addresses`` maps role → address (inproc://, ipc://, tcp://)."""

    transport: str = "ipc"  # inproc | ipc | tcp
    addresses: dict[str, str] = {}
    run_dir: str = ""
    heartbeat_s: float = 0.5
    heartbeat_misses: int = 6
    request_timeout_s: float = 60.0
    max_message_bytes: int = 256 * 1024 * 1024
    restart: dict[str, int] = {}  # role → max restarts (absent: 0)


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig = ModelConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    server: ServerConfig = ServerConfig()
    deploy: DeployConfig = DeployConfig()
    log_level: str = "info"
