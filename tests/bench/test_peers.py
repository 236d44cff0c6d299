"""Fair peers (bench/peers.py): every engine on the same cores, each in the dtypes asked
for, vLLM's own thread binding told to use them all. No engine is started."""

from __future__ import annotations

from pathlib import Path

from bench import peers

FILES = peers.ModelFiles(Path("/m/model.gguf"), Path("/m/hf"))
NAMES = ["actorlm", "vllm", "llamacpp", "transformers"]


def plan(best: str, peer_dtypes: list[str], cpus: list[int]) -> list[peers.EngineSpec]:
    return peers.plan_runs(NAMES, peers.engines(), peer_dtypes, ["auto"], cpus, best)


def test_each_peer_runs_in_its_best_dtype_and_in_fp32() -> None:
    runs = plan("bfloat16", ["best", "float32"], [0, 1])
    assert [(r.name, r.dtype) for r in runs] == [
        ("actorlm", "auto"),
        ("vllm", "bfloat16"),
        ("vllm[float32]", "float32"),
        ("llamacpp", ""),  # the GGUF's own blocks: no dtype to choose
        ("transformers", "bfloat16"),
        ("transformers[float32]", "float32"),
    ]
    assert runs[2].label == "vLLM (CPU) float32"
    # on a CPU without native bf16 the best is fp32: one run each
    assert [r.name for r in plan("float32", ["best", "float32"], [0, 1])] == NAMES


def test_every_engine_gets_the_same_cores() -> None:
    runs = {r.name: r for r in plan("float32", ["best"], [0, 1, 2, 3])}
    actorlm = runs["actorlm"].argv(runs["actorlm"], FILES, "127.0.0.1", 9)
    assert actorlm[actorlm.index("--num-threads") + 1] == "4"
    assert actorlm[actorlm.index("--dtype") + 1] == "auto"
    vllm = runs["vllm"]
    env = vllm.run_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # no core kept for its front end
    argv = vllm.argv(vllm, FILES, "127.0.0.1", 9)
    assert argv[argv.index("--dtype") + 1] == "float32"
    llama = runs["llamacpp"].argv(runs["llamacpp"], FILES, "127.0.0.1", 9)
    assert llama[llama.index("--n_threads") + 1] == "4"
    assert runs["transformers"].run_env() == {"OMP_NUM_THREADS": "4"}


def test_cpu_lists_in_the_form_omp_reads() -> None:
    assert peers.cpu_list([0, 1]) == "0-1"
    assert peers.cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert peers.cpu_list([3]) == "3"


def test_actorlm_on_int8_rows_runs_in_actorlm_dtypes_with_its_method() -> None:
    runs = peers.plan_runs(
        ["actorlm", "actorlm-a8"], peers.engines(), ["best"], ["auto"], [0, 1], "bfloat16"
    )
    assert [(r.name, r.dtype) for r in runs] == [("actorlm", "auto"), ("actorlm-a8", "auto")]
    argv = runs[1].argv(runs[1], FILES, "127.0.0.1", 9)
    assert argv[argv.index("--quantization") + 1] == "gguf_a8"
    assert argv[argv.index("--num-threads") + 1] == "2"
    assert "--quantization" not in runs[0].argv(runs[0], FILES, "127.0.0.1", 9)


def test_actorlm_on_the_safetensors_reads_what_vllm_reads_dense() -> None:
    runs = peers.plan_runs(["actorlm-hf"], peers.engines(), ["best"], ["auto"], [0, 1], "bfloat16")
    assert [(r.name, r.dtype) for r in runs] == [("actorlm-hf", "auto")]
    assert runs[0].needs_hf_dir
    argv = runs[0].argv(runs[0], FILES, "127.0.0.1", 9)
    assert argv[argv.index("--model") + 1] == str(FILES.hf_dir)
    assert argv[argv.index("--quantization") + 1] == "none"


def test_footnotes_say_what_each_engine_read(tmp_path: Path) -> None:
    engines = peers.engines()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    on_gguf = peers.ModelFiles(gguf, tmp_path / "hf")
    assert engines["actorlm"].describe(on_gguf) == "`actorlm serve` on the GGUF"
    assert "fp32 safetensors dequantized from the same GGUF" in engines["vllm"].describe(on_gguf)
    # a model folder, read by actorlm and vLLM alike: no GGUF named anywhere
    folder = tmp_path / "qwen3-moe"
    folder.mkdir()
    notes = [e.describe(peers.ModelFiles(folder, folder)) for e in engines.values()]
    assert not any("GGUF" in n for n in notes), notes
    assert engines["actorlm"].describe(peers.ModelFiles(folder, folder)) == (
        "`actorlm serve` on the model folder qwen3-moe"
    )
    assert "vllm-cpu 0.32.0 on the same folder," in engines["vllm"].describe(
        peers.ModelFiles(folder, folder)
    )
