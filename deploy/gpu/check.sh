#!/usr/bin/env bash
# trainyard on a real GPU node: one script that exercises every GPU path and writes what it
# measured. Run it on the node from the root of a checkout whose release binaries are in
# $TRAINYARD_BIN (default target/release), with a python3 that has torch (the reference and the
# library locations come from it). See docs/gpu.md.
#
#   TRAINYARD_BIN=target/release deploy/gpu/check.sh [RESULTS_DIR]
#
# Steps (each logged to RESULTS_DIR/<step>.log; a failing step does not stop the others):
#   facts      nvidia-smi, nvidia-smi topo -m, torch/CUDA/NCCL versions, `trainyard-engine info`
#   preflight  `trainyard-agent preflight --level full` (text and JSON) through NVML, CUDA, NCCL
#   topo       `trainyard-agent topo`: NVML's matrix compared cell for cell with nvidia-smi's
#   engine     the built-in engine in bf16 (d12, and d20) and the PyTorch reference (eager and
#              torch.compile), same config, same GPU; summary.json compares them
#   cluster    controller + agent (NVML, no host file) + a builtin job with a `standard` launch
#              preflight, checkpoints, its rank SIGKILLed and restarted, resuming
# Environment: STEPS (default 30), SKIP="engine compile d20 cluster" to leave steps out.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="$(cd "${TRAINYARD_BIN:-target/release}" 2>/dev/null && pwd)" || {
    echo "check.sh: no binaries in ${TRAINYARD_BIN:-target/release}: build with cargo build --release --bins or set TRAINYARD_BIN" >&2
    exit 1
}
RES="${1:-$ROOT/gpu-results}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
STEPS="${STEPS:-30}"
SKIP="${SKIP:-}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    sleep 1
    for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
    pkill -KILL -f "$BIN/trainyard-engine" 2>/dev/null
    rm -rf "$WORK" "${GPU_LIBS:-}"
}
trap cleanup EXIT
say() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" | tee -a "$RES/progress.log"; }
skipped() { [[ " $SKIP " == *" $1 "* ]]; }

# Libraries from the python's torch wheel (libs.sh).
# shellcheck source=deploy/gpu/libs.sh
source "$ROOT/deploy/gpu/libs.sh"
NCCL_SO="$TRAINYARD_NCCL_LIBRARY"
say "binaries $BIN; libtorch $TORCH_DIR/lib; NCCL $NCCL_SO; results $RES"

# --- facts ---------------------------------------------------------------------------------
say "facts"
{
    nvidia-smi
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,ecc.mode.current,power.limit --format=csv
    nproc; numactl --hardware 2>/dev/null || cat /sys/devices/system/node/node*/cpulist
    uname -a
} >"$RES/facts.log" 2>&1
nvidia-smi topo -m >"$RES/nvidia-smi-topo.txt" 2>&1
"$PY" - >"$RES/torch.json" 2>&1 <<'PY'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "device": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0)}))
PY
"$BIN/trainyard-engine" info >"$RES/engine-info.json" 2>&1

# --- preflight -----------------------------------------------------------------------------
say "preflight --level full"
timeout 240 "$BIN/trainyard-agent" preflight --level full -o json >"$RES/preflight-full.json" 2>"$RES/preflight.log"
echo "exit $?" >>"$RES/preflight.log"
timeout 240 "$BIN/trainyard-agent" preflight --level full >"$RES/preflight-full.txt" 2>>"$RES/preflight.log"

say "topo: NVML's matrix against nvidia-smi topo -m"
"$BIN/trainyard-agent" topo >"$RES/topo.txt" 2>&1
echo "exit $?" >>"$RES/topo.txt"

# --- engine vs reference -------------------------------------------------------------------
say "tokenize"
"$BIN/trainyard-engine" tokenize --out "$WORK/shards" engine/corpus/*.txt >"$RES/tokenize.log" 2>&1
# depth batch: the per-rank batch that fits 80 GB in eager PyTorch with the fp32 logits of a
# 50,257-token vocabulary (nanochat's d12 runs batch 32 compiled).
run_pair() {
    local depth=$1 batch=$2 seq=2048 tag="d$1"
    local args=(--seq-len "$seq" --device-batch-size "$batch" --total-batch-size $((batch * seq))
        --num-iterations "$STEPS" --warmup-steps 5 --lr-scale 1)
    say "engine $tag (batch $batch x $seq, $STEPS steps, bf16)"
    TRAINYARD_RECEIPTS="$RES/engine-$tag.jsonl" timeout 180 "$BIN/trainyard-engine" train --device cuda \
        --preset "$tag" --vocab-size 50257 --train "$WORK/shards/train_000000.bin" \
        --export-init "$WORK/init-$tag.safetensors" "${args[@]}" >"$RES/engine-$tag.log" 2>&1
    echo "exit $?" >>"$RES/engine-$tag.log"
    say "reference $tag eager"
    timeout 180 "$PY" engine/reference/gpt_ref.py --device cuda --weights "$WORK/init-$tag.safetensors" \
        --depth "$depth" --train "$WORK/shards/train_000000.bin" "${args[@]}" \
        >"$RES/reference-$tag-eager.json" 2>"$RES/reference-$tag-eager.log"
    if ! skipped compile; then
        say "reference $tag torch.compile"
        timeout 300 "$PY" engine/reference/gpt_ref.py --device cuda --compile \
            --weights "$WORK/init-$tag.safetensors" --depth "$depth" \
            --train "$WORK/shards/train_000000.bin" "${args[@]}" \
            >"$RES/reference-$tag-compile.json" 2>"$RES/reference-$tag-compile.log"
    fi
    rm -f "$WORK/init-$tag.safetensors"
}
if ! skipped engine; then
    run_pair 12 16
    skipped d20 || SKIP="$SKIP compile" run_pair 20 8
    "$PY" deploy/gpu/summarize.py "$RES" >"$RES/summary.txt" 2>&1
    cat "$RES/summary.txt"
fi

# --- a job through the cluster ---------------------------------------------------------------
if ! skipped cluster; then
    say "cluster: controller + NVML agent + builtin job with restart"
    timeout 300 bash deploy/gpu/cluster.sh "$BIN" "$WORK" "$RES" >"$RES/cluster.log" 2>&1
    echo "exit $?" >>"$RES/cluster.log"
    tail -n 30 "$RES/cluster.log"
fi
say "done"
