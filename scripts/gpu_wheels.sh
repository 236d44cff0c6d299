#!/usr/bin/env bash
# Wheels for a CUDA machine that reaches no package registry but has an image with a CUDA
# build of PyTorch, transformers, triton, numpy, aiohttp and pytest (a typical GPU image):
#   scripts/gpu_wheels.sh [PYTHON_VERSION] [DIR]     # default: 3.12 .whl
# downloads, here, what actorlm needs beyond that image: its own dependencies that such
# images lack (msgspec, pyzmq, gguf, the grammar backends and what they import). Copy DIR
# there; scripts/gpu_check.sh installs it before the checks. Nothing else is pulled:
# every wheel is fetched without its dependencies, which are listed here instead.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
dir=${2:-.whl}
mkdir -p "$dir"
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
platforms=()
for p in manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done

fetch() {
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp "${platforms[@]}" -d "$dir" "$@"
}

fetch msgspec pyzmq gguf "xgrammar>=0.2.8,<0.3" "llguidance>=1.9,<2" apache-tvm-ffi \
    pydantic annotated-types typing-inspection "typing-extensions>=4.16"
# pydantic pins its core exactly: the version its metadata names
core=$(unzip -p "$dir"/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
fetch "pydantic-core==$core"
ls "$dir"
