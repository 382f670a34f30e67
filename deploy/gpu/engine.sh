#!/usr/bin/env bash
# The engine on one GPU: its GPU tests (our kernels launched and compared with their reference
# paths), then deploy/gpu/engine_bench.py (the engine against torch.compile and eager PyTorch,
# alternating runs). Run from the root of a checkout, with a python3 that has torch:
#
#   deploy/gpu/engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]
#
# BIN_DIR holds a release trainyard-engine; each TEST_BINARY (a `cargo test --release --no-run`
# binary of the engine) is run whole, its output in RESULTS_DIR/gpu-tests.log. BENCH_ARGS are
# passed to engine_bench.py (e.g. "--rounds 1 --skip d20"). PROFILE=1 then profiles d12 steps of
# the engine (--profile-steps) and of eager and compiled PyTorch (deploy/gpu/profile_ref.py), and
# sums each trace the same way (deploy/gpu/trace_table.py) into RESULTS_DIR/profile-*.txt;
# PROFILE_MODES picks the PyTorch modes (default "eager compile"; "none" for the engine alone).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="$(cd "${1:?usage: engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]}" && pwd)" || exit 1
RES="${2:?usage: engine.sh BIN_DIR RESULTS_DIR [TEST_BINARY...]}"
shift 2
mkdir -p "$RES"
PY="${PYTHON:-python3}"
# Libraries from the python's torch wheel (libs.sh).
# shellcheck source=deploy/gpu/libs.sh
source "$ROOT/deploy/gpu/libs.sh"
WORK="$(mktemp -d)"
trap 'rm -rf "$GPU_LIBS" "$WORK"' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >"$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"
for t in "$@"; do
    echo "== $t" | tee -a "$RES/gpu-tests.log"
    "$t" --test-threads 1 --nocapture 2>&1 | tee -a "$RES/gpu-tests.log" | grep -E "^test |skipped|panicked|test result"
done
# shellcheck disable=SC2086
"$PY" deploy/gpu/engine_bench.py --bin "$BIN" --work "$WORK" "$RES" ${BENCH_ARGS:-}
if [[ "${PROFILE:-0}" == 1 && -e "$WORK/init-d12.safetensors" ]]; then
    echo "profile: d12 engine, steps 6-9"
    TRAINYARD_RECEIPTS="$WORK/profile-engine.jsonl" "$BIN/trainyard-engine" train --device cuda \
        --preset d12 --vocab-size 50257 --train "$WORK/shards/train_000000.bin" --seq-len 2048 \
        --device-batch-size 16 --total-batch-size 32768 --num-iterations 9 --warmup-steps 5 \
        --init-weights "$WORK/init-d12.safetensors" ${PROFILE_ENGINE_ARGS:-} \
        --profile-steps 6-9 --profile-out "$WORK/trace-engine.json" >"$RES/profile-engine.log" 2>&1
    "$PY" deploy/gpu/trace_table.py "$WORK/trace-engine.json" 4 >"$RES/profile-engine.txt" 2>&1
    head -n 30 "$RES/profile-engine.txt" | cut -c1-160
    for mode in ${PROFILE_MODES:-eager compile}; do
        [[ $mode == none ]] && continue
        echo "profile: d12 $mode"
        flag=(); [[ $mode == compile ]] && flag=(--compile)
        "$PY" deploy/gpu/profile_ref.py --trace "$WORK/trace-$mode.json" -- --device cuda "${flag[@]}" \
            --weights "$WORK/init-d12.safetensors" --depth 12 --train "$WORK/shards/train_000000.bin" \
            --seq-len 2048 --device-batch-size 16 --total-batch-size 32768 --num-iterations 8 \
            --warmup-steps 5 >"$RES/profile-$mode.json" 2>"$RES/profile-$mode.log"
        "$PY" deploy/gpu/trace_table.py "$WORK/trace-$mode.json" 4 >"$RES/profile-$mode.txt" 2>&1
        head -n 30 "$RES/profile-$mode.txt" | cut -c1-160
    done
fi
