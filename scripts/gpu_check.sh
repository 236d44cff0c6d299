#!/usr/bin/env bash
# The checks a CUDA machine runs for the cuda platform (issue 20), in one go:
#   scripts/gpu_check.sh [OUT_DIR]
# Uses $PYTHON (default: .venv/bin/python, else python3), which must have a CUDA build of
# torch; triton and flashinfer are used where they import (nothing is downloaded here).
# On an image without actorlm's other dependencies, copy in the wheels of
# scripts/gpu_wheels.sh first (.whl/, or $WHEELS): they are installed, and actorlm too
# (editable, offline) where it does not import yet.
# 1. the GPU tests and the Triton kernel tests (compiled on CUDA tensors when a GPU is
#    present), 2. bench/gpu.py for each CUDA backend that imports, then its decode steps
#    again with the element-wise layers on PyTorch. Writes OUT_DIR
#    (default bench/results/gpu-check): pytest's log, the benchmark's JSON and table.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu-check}
mkdir -p "$out"
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
wheels=${WHEELS:-.whl}
if ! "$python" -c "import actorlm.engine, xgrammar, llguidance" 2>/dev/null; then
    if compgen -G "$wheels/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl || exit 1
    fi
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi

"$python" - <<'PY' | tee "$out/versions.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in ("triton", "flashinfer"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "unavailable:", repr(exc)[:200])
PY

backends=$("$python" -c "
import importlib.util as u
print(','.join(n for n in ('flashinfer', 'triton') if u.find_spec(n)))")

"$python" -m pytest -q -rs -p no:cacheprovider \
    tests/gpu/test_cuda_backends.py tests/gpu/test_cuda_graphs.py tests/gpu/test_platforms.py \
    tests/gpu/attention tests/gpu/lora tests/gpu/kernels/test_triton_elementwise.py \
    tests/gpu/test_sampling.py tests/gpu/test_cuda_serve.py tests/extensions/test_discovery.py \
    2>&1 | tee "$out/pytest.txt"
tests_rc=${PIPESTATUS[0]}

"$python" bench/gpu.py --attention-backends "$backends" --profile-batch 1 --out "$out/gpu.json" 2>&1 | tee "$out/bench.txt"
bench_rc=${PIPESTATUS[0]}
# The same decode steps with the element-wise layers on PyTorch (ACTORLM_NATIVE=0 refuses
# triton/elementwise.py): what those kernels save, measured in the same run
ACTORLM_NATIVE=0 "$python" bench/gpu.py --attention-backends "$backends" --skip-offline \
    --batch-sizes 1,64,256 --out "$out/gpu-torch-elementwise.json" 2>&1 | tail -12
echo "pytest rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
