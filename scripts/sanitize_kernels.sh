#!/usr/bin/env bash
# The native kernels' tests on a sanitizer build of every C kernel:
#   scripts/sanitize_kernels.sh [undefined|address] [PYTEST ARGS...]
# `undefined` (the default) builds with UBSan and stops at the first undefined behaviour;
# `address` builds with ASan (out-of-bounds reads and writes on the tensors torch
# allocates), with libasan and libstdc++ preloaded into Python so that torch's own C++
# exceptions still unwind. The builds go to a cache of their own (ACTORLM_CACHE_DIR), so
# the normal ones are untouched. Needs gcc. Default tests: the kernels', the attention
# backends' and the models' (ASan: 289 tests in ~7 minutes on 2 cores, compiles included).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-undefined}
shift || true
case "$kind" in
    undefined) flags="-fsanitize=undefined -fno-sanitize-recover=undefined" ;;
    address) flags="-fsanitize=address" ;;
    *) echo "usage: $0 [undefined|address] [pytest args...]" >&2; exit 2 ;;
esac
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#!/bin/sh\nexec gcc "$@" %s -fno-omit-frame-pointer\n' "$flags" >"$work/cc"
chmod +x "$work/cc"
export CC="$work/cc" ACTORLM_CACHE_DIR="$work/cache"
if [ "$kind" = address ]; then
    export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
    export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:verify_asan_link_order=0
fi
if [ $# -eq 0 ]; then
    set -- tests/gpu/kernels tests/gpu/test_cpu_attention.py tests/gpu/test_bf16.py \
        tests/gpu/test_models.py tests/gpu/test_gguf.py tests/gpu/lora \
        --deselect tests/gpu/kernels/test_amx_build.py
fi
# --capture=sys: a sanitizer report goes to file descriptor 2, which must stay the terminal
"$python" -m pytest -q -p no:cacheprovider --capture=sys "$@"
