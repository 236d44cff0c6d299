"""One frozen configuration tree, built once (CLI, Engine kwargs or a deployment
file) and passed to every actor. Nothing reads the environment except
``extensions.plugins``; nothing mutates this after start-up."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "DEFAULT_MAX_LORA_RANK",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "CacheConfig",
    "DeployConfig",
    "EngineConfig",
    "GrammarConfig",
    "LoraConfig",
    "ModelConfig",
    "RouterConfig",
    "SchedulerConfig",
    "ServerConfig",
]


# The per-step prefill budget where neither the user nor a platform chose one.
DEFAULT_MAX_PREFILL_TOKENS = 2048
# The LoRA slots' rank when neither --max-lora-rank nor the adapters of --lora-paths set it.
DEFAULT_MAX_LORA_RANK = 64


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str = ""  # HF folder or .gguf file; "" = the embedded default model
    load_format: str = "auto"  # auto | safetensors | layered | gguf | a plugin's name
    # native: a registered model; transformers: the fallback (any decoder-only HF model,
    # attention on actorlm's backends); auto: native where registered, else the fallback
    model_impl: str = "auto"
    # auto = the platform's: bfloat16 on CUDA and on CPUs with native bf16, else float32
    dtype: str = "auto"
    device: str = ""  # "" = the active platform's device
    attention_backend: str = ""  # "" = the platform's default
    quantization: str = ""  # none | fp16 | a plugin's; "" = the platform's default
    page_size: int = 16
    # memory budget for the paged KV pool; 0 = the platform's: 1 GiB on the CPU, on CUDA
    # what --mem-fraction-static leaves of the device's free memory after the weights
    kv_cache_gb: float = 0.0
    mem_fraction_static: float = 0.0  # CUDA: share of device memory for weights + KV; 0 = 0.88
    num_pages: int = 0  # 0 = derive from kv_cache_gb
    max_model_len: int = 0  # 0 = from the model's config
    vocab_size: int = 0  # 0 = from the model's config (resolve_config fills it)
    num_threads: int = 0  # torch threads in the worker; 0 = all cores
    # CPU: steps of up to this many rows in one native call (-1: 640 on AMX tiles, else 32)
    fused_decode_max_batch: int = -1
    served_model_name: str = ""
    seed: int = 0
    disable_cuda_graph: bool = False  # CUDA: run decode steps eagerly instead of replaying graphs
    cuda_graph_max_bs: int = (
        0  # CUDA: the largest decode batch captured; 0 = max-running-requests, at most 256
    )


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    policy: str = "fcfs"  # fcfs | lpm | priority
    max_running_requests: int = 64
    max_prefill_tokens: int = 0  # per-step token budget (chunked prefill); 0 = the platform's
    # a decode's pages asked for this many at a time, one run of ids; 0 = the platform's
    decode_page_run: int = 0
    max_queued_requests: int = 1024
    max_queue_time_s: float = (
        0.0  # a request not started after this long fails; 0: the request timeout
    )
    step_timeout_s: float = 300.0
    # Running requests when the worker (or cache manager) is lost: "fail" them with an
    # error, or "recompute" them from their tokens on its successor.
    on_worker_loss: str = "fail"
    # Plan and send step N+1 while the worker runs step N (the same tokens either way).
    disable_overlap_schedule: bool = False
    # A "Decode batch." log line every this many decode-only steps (and a "Prefill batch."
    # line for every step with prompt tokens), as SGLang's scheduler logs; 0: none
    decode_log_interval: int = 40
    # A request's tokens go to its tokenizer every this many (its first and last at
    # once): fewer messages a token for the tokenizer and the client (SGLang's flag).
    stream_interval: int = 1


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    enable_prefix_cache: bool = True
    eviction_policy: str = "lru"
    hicache_storage_backend: str = ""  # "" = off; "file" built in
    hicache_storage_dir: str = ""


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapters on the base model (the lora_loader actor runs when enabled)."""

    enable_lora: bool = False  # serve adapters (implied by lora_paths); loaded later by API
    # Adapters loaded at start: "name=path", "name=path:pinned" (kept in a slot), or a
    # bare path (named after its folder).
    lora_paths: list[str] = []
    max_loras_per_batch: int = 8  # worker slots: distinct adapters one batch can mix
    max_loaded_loras: int = 0  # adapters the loader holds in host memory; 0 = no limit
    max_lora_rank: int = 0  # the slots' rank; 0 = the largest of lora_paths, else 64
    lora_eviction_policy: str = "lru"  # which slot an adapter that needs one takes

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""
    admin_api_key: str = ""  # if set, control routes (abort, flush, adapters) need this key
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 128  # the most choices one request may ask for (n times its prompts)
    trust_request_chat_template: bool = False  # let requests bring their own jinja template
    chat_template_timeout_s: float = 5.0  # a render that takes longer fails its request (400)
    max_prompt_chars: int = 0  # longer prompts are refused before tokenizing; 0: 64 x context
    drain_timeout_s: float = 5.0


class GrammarConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Structured output (``actorlm.gpu.grammar``) and reasoning output."""

    grammar_backend: str = "xgrammar"  # xgrammar | llguidance | none | a plugin's
    # Where a constraint the backend cannot compile goes next: "auto" = the other
    # built-in (xgrammar <-> llguidance), "none" = nowhere (400), or a backend's name.
    grammar_fallback: str = "auto"
    grammar_compile_timeout_s: float = 5.0  # a compile taking longer fails its request (400)
    grammar_compile_threads: int = 2  # compiles at once, in the worker, off its event loop
    grammar_cache_entries: int = 512  # compiled constraints kept (LRU), keyed by constraint
    # JSON: any whitespace between tokens (xgrammar's any_whitespace, llguidance's
    # whitespace_flexible). Off: compact JSON, which small models cannot pad forever.
    grammar_any_whitespace: bool = False
    reasoning_parser: str = ""  # "" = off | deepseek-r1 | qwen3 | qwen3-thinking | a plugin's


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Data-parallel replicas (each its own scheduler, cache manager and worker) behind
    the tokenizer's router (``actorlm.actors.router``)."""

    dp_size: int = 1  # replicas; 1 = the single pipeline, no router
    router_policy: str = ""  # cache_aware | round_robin | least_load | a plugin's; "" = cache_aware
    # cache_aware (SGLang router semantics): the replica with the longest cached prefix
    # when it covers this share of the prompt, unless the loads are unbalanced ...
    router_cache_threshold: float = 0.5
    router_balance_abs: int = 32  # ... by more than this many requests ...
    router_balance_rel: float = 1.5  # ... and the busiest has more than this x the idlest's
    # Prefill/decode disaggregation: replicas after the dp_size decode ones prefill only;
    # a prompt with more uncached tokens than max_local_prefill_tokens is computed there
    # and its KV pages shipped to the decode replica (messages/kv.py).
    prefill_replicas: int = 0
    max_local_prefill_tokens: int = 256
    kv_transfer_timeout_s: float = 60.0  # a remote prefill not back by then fails
    # ... unless each prefill replica up holds this many already: then here (0: no limit)
    max_prefill_queue: int = 0


class DeployConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where actors live. ``addresses`` maps role → address (inproc://, unix://, ipc://, tcp://)."""

    transport: str = "unix"  # unix | ipc | tcp (in one process, placement "inproc")
    addresses: dict[str, str] = {}
    run_dir: str = ""
    heartbeat_s: float = 0.5  # every actor heartbeats each peer this often
    peer_timeout_s: float = 3.0  # a peer silent this long is down (a hung child is killed)
    request_timeout_s: float = 60.0
    start_timeout_s: float = 600.0  # waiting for every actor to be ready
    max_message_bytes: int = 256 * 1024 * 1024
    restart_policy: str = "on-failure"  # on-failure | never: what the launcher does on a death
    max_restarts: int = 5  # per role within restart_window_s; then it stays down
    restart_window_s: float = 300.0
    restart_backoff_s: float = 0.5  # after a death soon after a start; doubles, up to 10 s
    keys_dir: str = ""  # CurveZMQ keys (`actorlm keys DIR`) for every tcp socket
    insecure: bool = False  # allow binding tcp beyond loopback without keys
    # CPUs each replica's worker process is pinned to ("0", "2-3", "0,4"), one per replica
    # (replica i takes the i-th); empty: not pinned
    worker_cpus: list[str] = []
    # serve: where the pipeline's actors run: local processes, or Ray actors placed on a
    # Ray cluster the user runs (the `ray` extra; actors/runtime/ray_launcher.py)
    launcher: str = "local"  # local | ray
    ray_address: str = "auto"  # the cluster, as ray.init takes it
    ray_worker_cpus: float = 1.0  # Ray CPUs a worker asks for (a GPU instead on CUDA)
    ray_actor_cpus: float = 0.25  # Ray CPUs every other actor asks for


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig = ModelConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    lora: LoraConfig = LoraConfig()
    server: ServerConfig = ServerConfig()
    grammar: GrammarConfig = GrammarConfig()
    router: RouterConfig = RouterConfig()
    deploy: DeployConfig = DeployConfig()
    plugins: dict[str, dict[str, Any]] = {}  # plugin name → its settings (register(settings))
    log_level: str = "info"
