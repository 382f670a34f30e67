#!/usr/bin/env bash
# The agent's NVML sampler against nvidia-smi on a real GPU, idle and under load, then the
# preflight's CUDA and NCCL checks. Read-only: nothing here changes a GPU setting. Run from the
# root of a checkout with a python3 that has torch:
#
#   deploy/gpu/telemetry.sh BIN_DIR RESULTS_DIR
#
# Each phase runs `trainyard-agent telemetry -o json` (one reading a second) and
# `nvidia-smi --query-gpu=... -lms 1000` side by side for SECONDS (default 12) and takes
# `nvidia-smi -q` in the middle; the load is the built-in engine's d12 (batch 16 x 2048, bf16),
# sampled once its first steps are done. deploy/gpu/telemetry_compare.py pairs the readings by
# time and writes compare.txt. Files: {idle,load}-agent.jsonl, {idle,load}-smi.csv,
# {idle,load}-smi-q.txt, engine.log and engine.jsonl, preflight-full.{json,txt}, compare.txt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="$(cd "${1:?usage: telemetry.sh BIN_DIR RESULTS_DIR}" && pwd)" || exit 1
RES="${2:?usage: telemetry.sh BIN_DIR RESULTS_DIR}"
mkdir -p "$RES"
PY="${PYTHON:-python3}"
SECONDS_EACH="${SECONDS_EACH:-12}"
# shellcheck source=deploy/gpu/libs.sh
source "$ROOT/deploy/gpu/libs.sh"
WORK="$(mktemp -d)"
ENGINE=""
trap '[[ -n "$ENGINE" ]] && kill -KILL "$ENGINE" 2>/dev/null; rm -rf "$GPU_LIBS" "$WORK"' EXIT
say() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" | tee -a "$RES/progress.log"; }

# Every field nvidia-smi answers here, of those the sampler reads (a field this driver does not
# know would fail the whole query, so each is tried alone first).
WANT="timestamp,index,uuid,clocks.sm,clocks.mem,clocks.max.sm,clocks_event_reasons.active,\
power.draw,power.draw.average,power.draw.instant,enforced.power.limit,temperature.gpu,\
temperature.memory,utilization.gpu,memory.used,pcie.link.gen.current,pcie.link.gen.max,\
pcie.link.width.current,pcie.link.width.max,ecc.errors.corrected.volatile.total,\
ecc.errors.uncorrected.volatile.total,remapped_rows.pending,remapped_rows.failure"
FIELDS=""
for f in ${WANT//,/ }; do
    if nvidia-smi --query-gpu="$f" --format=csv,noheader >/dev/null 2>&1; then
        FIELDS="${FIELDS:+$FIELDS,}$f"
    else
        echo "nvidia-smi does not answer $f" | tee -a "$RES/progress.log"
    fi
done
# The fields asked (the CSV's columns, in order) and the zone its timestamps are in.
{ echo "$FIELDS"; date +%z; } >"$RES/smi-fields.txt"
nvidia-smi >"$RES/nvidia-smi.txt" 2>&1
nvidia-smi nvlink -s >"$RES/nvidia-smi-nvlink.txt" 2>&1

# phase NAME: the sampler and nvidia-smi side by side for SECONDS_EACH, nvidia-smi -q halfway.
phase() {
    local name=$1
    say "$name: sampler and nvidia-smi for ${SECONDS_EACH}s"
    nvidia-smi --query-gpu="$FIELDS" --format=csv,nounits -lms 1000 >"$RES/$name-smi.csv" 2>&1 &
    local smi=$!
    "$BIN/trainyard-agent" telemetry --count "$SECONDS_EACH" --telemetry-every-secs 1 -o json \
        >"$RES/$name-agent.jsonl" 2>"$RES/$name-agent.log" &
    local agent=$!
    sleep $((SECONDS_EACH / 2))
    nvidia-smi -q >"$RES/$name-smi-q.txt" 2>&1
    wait "$agent"
    echo "exit $?" >>"$RES/$name-agent.log"
    sleep 1
    kill -INT "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
}

phase idle

say "load: the engine's d12 (batch 16 x 2048, bf16)"
"$BIN/trainyard-engine" tokenize --out "$WORK/shards" engine/corpus/*.txt >"$RES/tokenize.log" 2>&1
TRAINYARD_RECEIPTS="$RES/engine.jsonl" "$BIN/trainyard-engine" train --device cuda --preset d12 \
    --vocab-size 50257 --train "$WORK/shards/train_000000.bin" --seq-len 2048 --device-batch-size 16 \
    --total-batch-size 32768 --num-iterations 2000 --warmup-steps 5 >"$RES/engine.log" 2>&1 &
ENGINE=$!
for _ in $(seq 600); do
    [[ "$(grep -c '"kind":"step"' "$RES/engine.jsonl" 2>/dev/null)" -ge 10 ]] && break
    kill -0 "$ENGINE" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$ENGINE" 2>/dev/null; then
    phase load
    kill -TERM "$ENGINE" 2>/dev/null
    wait "$ENGINE" 2>/dev/null
else
    say "load: the engine ended before its 10th step (engine.log)"
    tail -n 20 "$RES/engine.log"
fi
ENGINE=""
# The receipts file is the engine's own: keep its first and last 20 lines, not thousands.
if [[ -f "$RES/engine.jsonl" ]]; then
    { head -n 20 "$RES/engine.jsonl"; tail -n 20 "$RES/engine.jsonl"; } >"$WORK/e" && mv "$WORK/e" "$RES/engine.jsonl"
fi

say "preflight --level full (CUDA on every GPU, NCCL sweep to 1 GiB)"
timeout 240 "$BIN/trainyard-agent" preflight --level full -o json >"$RES/preflight-full.json" 2>"$RES/preflight.log"
echo "exit $?" >>"$RES/preflight.log"
timeout 240 "$BIN/trainyard-agent" preflight --level full >"$RES/preflight-full.txt" 2>>"$RES/preflight.log"

"$PY" deploy/gpu/telemetry_compare.py "$RES" >"$RES/compare.txt" 2>&1
cat "$RES/compare.txt"
say "done"
