#!/usr/bin/env bash
# The engine on one GPU: its GPU tests (our kernels launched and compared with their reference
# paths), then deploy/gpu/engine_bench.py (the engine against torch.compile and eager PyTorch,
# alternating runs). Run from the root of a checkout, with a python3 that has torch:
#
#   deploy/gpu/engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]
#
# BIN_DIR holds a release trainyard-engine; each TEST_BINARY (a `cargo test --release --no-run`
# binary of the engine) is run whole, its output in RESULTS_DIR/gpu-tests.log. BENCH_ARGS are
# passed to engine_bench.py (e.g. "--rounds 1 --skip d20"). PROFILE=1 then profiles a d12 step of
# eager and compiled PyTorch (deploy/gpu/profile_ref.py) into RESULTS_DIR/profile-*.txt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="$(cd "${1:?usage: engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]}" && pwd)" || exit 1
RES="${2:?usage: engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]}"
shift 2
mkdir -p "$RES"
PY="${PYTHON:-python3}"
# Libraries from the python's torch wheel, as check.sh sets them up: libtorch, and the names
# cudarc looks for (libnccl.so, libnvrtc.so) as links in a private directory.
TORCH_DIR="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || {
    echo "engine.sh: $PY cannot import torch; set PYTHON to a python with torch" >&2
    exit 1
}
NV="$(dirname "$TORCH_DIR")/nvidia"
LIBS="$(mktemp -d)"
WORK="$(mktemp -d)"
trap 'rm -rf "$LIBS" "$WORK"' EXIT
ln -sf "$NV/nccl/lib/libnccl.so.2" "$LIBS/libnccl.so"
NVRTC_SO="$(ls "$NV"/cu*/lib/libnvrtc.so.* 2>/dev/null | head -n 1 || true)"
[[ -n "$NVRTC_SO" ]] && ln -sf "$NVRTC_SO" "$LIBS/libnvrtc.so"
export LD_LIBRARY_PATH="$TORCH_DIR/lib:$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TRAINYARD_NCCL_LIBRARY="$NV/nccl/lib/libnccl.so.2"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >"$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"
for t in "$@"; do
    echo "== $t" | tee -a "$RES/gpu-tests.log"
    "$t" --test-threads 1 --nocapture 2>&1 | tee -a "$RES/gpu-tests.log" | grep -E "^test |skipped|panicked|test result"
done
# shellcheck disable=SC2086
"$PY" deploy/gpu/engine_bench.py --bin "$BIN" --work "$WORK" "$RES" ${BENCH_ARGS:-}
if [[ "${PROFILE:-0}" == 1 && -e "$WORK/init-d12.safetensors" ]]; then
    for mode in eager compile; do
        echo "profile: d12 $mode"
        flag=(); [[ $mode == compile ]] && flag=(--compile)
        "$PY" deploy/gpu/profile_ref.py -- --device cuda "${flag[@]}" --weights "$WORK/init-d12.safetensors" \
            --depth 12 --train "$WORK/shards/train_000000.bin" --seq-len 2048 --device-batch-size 16 \
            --total-batch-size 32768 --num-iterations 8 --warmup-steps 5 \
            >"$RES/profile-$mode.json" 2>"$RES/profile-$mode.txt"
        grep -A 14 "profiled steps" "$RES/profile-$mode.txt" | cut -c1-160
    done
fi
