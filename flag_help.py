"""One line per ``actorlm serve`` / ``actorlm actor`` flag: what it does (the default
is added from the config). Every config field has one (a test checks), grouped as the
design's sections are."""

from __future__ import annotations

__all__ = ["FLAG_HELP", "GROUP_TITLES"]

GROUP_TITLES = {
    "model": "model",
    "scheduler": "scheduling",
    "cache": "cache",
    "server": "HTTP and request limits",
    "grammar": "structured output and reasoning",
    "lora": "LoRA adapters",
    "router": "data-parallel replicas and routing",
    "deploy": "deployment and liveness",
}

FLAG_HELP: dict[str, str] = {
    # model
    "path": "HF folder or .gguf file to serve (empty: the embedded SmolLM2-135M-Instruct)",
    "load_format": "weight loader: auto, safetensors, layered, gguf, or a plugin's",
    "model_impl": "auto (native where registered, else transformers), native or transformers",
    "dtype": "auto (bf16 where the device has native bf16, else fp32), float32, bfloat16, ...",
    "device": "torch device for the worker (empty: the platform's)",
    "attention_backend": "attention backend (empty: the platform's default; see actorlm plugins)",
    "quantization": "linear method: none, fp16, gguf, q8_0, q4_1, gguf_a8 / q8_0_a8 / q4_1_a8 (int8 rows, "
    "AVX2 or AVX512-VNNI), or a plugin's (empty: the platform's; with --dtype auto on an "
    "AVX512-VNNI CPU without native bf16, gguf_a8)",
    "page_size": "tokens per KV-cache page",
    "kv_cache_gb": "memory budget of the paged KV pool in GiB (0: the platform's)",
    "mem_fraction_static": "CUDA: share of free device memory for weights and KV pool",
    "num_pages": "KV pool size in pages (0: from the memory budget)",
    "max_model_len": "context length (0: the model's)",
    "vocab_size": "vocabulary size (0: the model's; filled at start)",
    "num_threads": "torch threads in the worker (0: every core it may use)",
    "fused_decode_max_batch": "CPU: steps of up to this many rows (decodes; prompts or cached-prefix extensions of up to 16 tokens a sequence, 512 on AMX tiles, a row each) as one native call (-1: 640 where a bf16 model runs on AMX tiles, else 32; 0: off)",
    "served_model_name": "the model's name in the API (empty: the folder or file name)",
    "seed": "the worker's random seed",
    "disable_cuda_graph": "CUDA: run decode steps eagerly instead of replaying graphs",
    "cuda_graph_max_bs": "CUDA: the largest decode batch captured as a graph",
    # scheduling
    "policy": "admission order: fcfs, lpm (longest cached prefix first) or priority (which also keeps short prompts from going before long ones being chunked)",
    "max_running_requests": "requests in the running batch at most",
    "max_prefill_tokens": "prompt tokens computed per step, chunked beyond (0: the platform's)",
    "decode_page_run": "a decode's KV pages asked for this many at a time, one run of ids, "
    "while a quarter of the pool stays available (0: the platform's: 8 on the CPU, else 1)",
    "max_queued_requests": "requests queued or running at most; more get 429/503 (0: no limit)",
    "max_queue_time_s": "a request not started after this long fails (0: --request-timeout-s)",
    "step_timeout_s": "a forward step taking longer than this fails its requests",
    "on_worker_loss": "running requests when the worker is lost: fail, or recompute them",
    "disable_overlap_schedule": "plan each step after the previous one returns (no overlap)",
    "decode_log_interval": "log a decode batch line (load, gen throughput, step time) every N "
    "decode steps, and a line for each prefill step; 0: no batch lines",
    "stream_interval": "stream a request's tokens every N of them (its first and last at once)",
    # cache
    "enable_prefix_cache": "share KV pages between prompts with a common prefix",
    "eviction_policy": "which cached pages go first: lru, lfu, fifo, ... or a plugin's",
    "hicache_storage_backend": "a storage tier for KV pages (file, or a plugin's; empty: none)",
    "hicache_storage_dir": "where the file tier keeps its pages",
    # HTTP and request limits
    "host": "address the HTTP server listens on",
    "port": "port of the HTTP server",
    "api_key": "clients must send 'Authorization: Bearer KEY' (empty: no key)",
    "admin_api_key": "control routes (abort, flush, adapters) need this key instead",
    "max_body_bytes": "largest request body, after decompression",
    "max_n": "most completions one request may ask for (n times its prompts)",
    "trust_request_chat_template": "let requests bring their own chat template (code!)",
    "chat_template_timeout_s": "a chat template render taking longer fails its request",
    "max_prompt_chars": "longer prompts are refused before tokenizing (0: 64 x the context)",
    "drain_timeout_s": "on SIGTERM or POST /drain, how long requests in flight may still run",
    # deployment and liveness
    "transport": (
        "how actors talk under serve: unix (default: Unix sockets, no ZMQ), ipc (Unix "
        "sockets through ZMQ) or tcp"
    ),
    "run_dir": "folder for unix and ipc sockets (empty: a fresh owner-only temporary one)",
    "heartbeat_s": "how often each actor tells its peers it is alive",
    "peer_timeout_s": "a peer silent this long is down (a hung child is killed)",
    "request_timeout_s": "how long one actor waits for another's answer",
    "start_timeout_s": "how long to wait for every actor to be ready",
    "max_message_bytes": "largest message an actor accepts",
    "restart_policy": "on-failure: restart a dead actor (serve); never: leave it down",
    "max_restarts": "restarts of one role within --restart-window-s, then it stays down",
    "restart_window_s": "the window --max-restarts counts in",
    "restart_backoff_s": "wait before restarting a role that died within 10 s of its start, doubling each time up to 10 s",
    "keys_dir": "CurveZMQ keys (actorlm keys DIR) for every tcp socket",
    "insecure": "allow tcp beyond loopback without keys: anyone reaching a port commands",
    "worker_cpus": "CPUs each replica's worker is pinned to, one per replica: 0 1, or 0-3 4-7",
    "launcher": "serve: local (processes here) or ray (Ray actors on your cluster; actorlm[ray])",
    "ray_address": "--launcher ray: the cluster, as ray.init takes it (auto, HOST:PORT)",
    "ray_worker_cpus": "--launcher ray: CPUs a worker asks Ray for (on CUDA one GPU instead)",
    "ray_actor_cpus": "--launcher ray: CPUs each other actor asks Ray for",
    # data-parallel replicas and routing
    "dp_size": "data-parallel replicas, each its own scheduler, cache manager and worker",
    "router_policy": "which replica takes a request: cache_aware, round_robin, least_load, a plugin's",
    "router_cache_threshold": "cache_aware: the longest cached prefix wins from this share of the prompt",
    "router_balance_abs": "cache_aware: loads are unbalanced when they differ by more than this ...",
    "router_balance_rel": "... and the busiest replica has more than this times the idlest's",
    "prefill_replicas": "prefill-only replicas: long prompts are computed there, KV shipped back",
    "max_local_prefill_tokens": "--prefill-replicas: prompts with at most this many uncached "
    "tokens are prefilled on the decode replica itself",
    "kv_transfer_timeout_s": "--prefill-replicas: a remote prefill not back by then fails",
    "max_prefill_queue": "--prefill-replicas: prompts a prefill replica holds at most "
    "(0: no limit); past that, decode replicas prefill long prompts themselves",
    # structured output and reasoning
    "grammar_backend": "grammar backend: xgrammar, llguidance, none, or a plugin's",
    "grammar_fallback": "where a constraint the backend cannot compile goes: auto, none, a name",
    "grammar_compile_timeout_s": "a constraint compiling longer fails its request (400)",
    "grammar_compile_threads": "constraints compiled at once in the worker",
    "grammar_cache_entries": "compiled constraints kept (LRU), keyed by constraint",
    "grammar_any_whitespace": "JSON constraints allow any whitespace (off: compact JSON)",
    "reasoning_parser": "split thinking into reasoning_content: deepseek-r1, qwen3, ... (empty: off)",
    # LoRA adapters
    "enable_lora": "serve LoRA adapters (loaded later through the API; implied by --lora-paths)",
    "lora_paths": "adapters to load at start: NAME=PATH, NAME=PATH:pinned or PATH",
    "max_loras_per_batch": "worker slots: distinct adapters one batch can mix",
    "max_loaded_loras": "adapters the loader keeps in host memory (0: no limit)",
    "max_lora_rank": "the slots' rank (0: the largest of --lora-paths, else 64)",
    "lora_eviction_policy": "which slot an adapter that needs one takes: lru, lfu, fifo, a plugin's",
}
