"""``actorlm serve --device cuda`` as users run it: the actor processes, ZMQ and HTTP, the
worker on the GPU with its default attention backend and CUDA graphs. Greedy tokens of
concurrent requests (graph replays of batches padded to a captured size) against
transformers' on the same GPU and weights, in fp32."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from actorlm.actors.runtime.transport import free_port

from tests.servers import http, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [list(range(300, 341)), [9, 8, 7, 6, 5] * 5, [1000, 2000, 3], [42] * 7, [17, 18]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cuda_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("cuda-serve") / "serve.log"
    cmd = [sys.executable, "-m", "actorlm.cli", "serve", "--model", str(tiny_llama)]
    cmd += ["--device", "cuda", "--dtype", "float32", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while http(f"{url}/health")[0] != 200:
            tail = log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline and proc.poll() is None, tail
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)


def test_concurrent_greedy_requests_match_transformers_on_the_gpu(
    cuda_server: str, tiny_llama: Path
) -> None:
    from transformers import AutoModelForCausalLM

    def generate(prompt: list[int]) -> list[int]:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        status, out = http(
            f"{cuda_server}/generate", {"input_ids": prompt, "sampling_params": params}
        )
        assert status == 200, out
        return list(out["output_ids"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(generate, PROMPTS))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).cuda().eval()
    for prompt, ours in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(prompt) :]
        assert ours == want.tolist(), prompt
    status, info = http(f"{cuda_server}/get_server_info")
    assert status == 200 and info["platform"]["name"] == "cuda", info
    assert info["config"]["model"]["device"].startswith("cuda"), info["config"]["model"]
