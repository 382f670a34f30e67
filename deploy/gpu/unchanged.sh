#!/usr/bin/env bash
# An unchanged script's receipts on a GPU: a Hugging Face Trainer run (tests/fixtures/scripts/
# hf_trainer.py --cuda, a 12-layer GPT-2 in bf16) as an `exec` job through a controller and an
# agent that describes the host through NVML and samples its telemetry; then the same script
# run directly with and without the bootstrap, alternating, for its cost. Run from the root of a
# checkout with release binaries of the controller, agent and ctl in BIN_DIR and a python3 with
# torch and transformers:
#
#   deploy/gpu/unchanged.sh BIN_DIR RESULTS_DIR
#
# Environment: STEPS (default 300) for the job, PAIRS (default 2) and PAIR_STEPS (default 120)
# for the alternating runs; SKIP_JOB=1 runs the alternating runs alone, with a bootstrap
# directory laid out from this checkout's python/ (and one unmeasured run first, to warm the
# machine's caches). deploy/gpu/unchanged_summary.py writes summary.txt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BIN="$(cd "${1:?usage: unchanged.sh BIN_DIR RESULTS_DIR}" && pwd)" || exit 1
RES="${2:?usage: unchanged.sh BIN_DIR RESULTS_DIR}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-300}" PAIRS="${PAIRS:-2}" PAIR_STEPS="${PAIR_STEPS:-120}"
# GPU_FLAG="" with AGENT_ARGS="--host-file FILE" runs the same pipeline on a CPU (a dry run).
GPU_FLAG="${GPU_FLAG---cuda}"
D="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    sleep 1
    for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
    rm -rf "$D"
}
trap cleanup EXIT
say() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" | tee -a "$RES/progress.log"; }
sql() { "$PY" -c 'import sqlite3,sys,json; c=sqlite3.connect(sys.argv[1]); print(json.dumps(c.execute(sys.argv[2]).fetchall()))' "$D/controller/trainyard.db" "$1"; }
SCRIPT="$ROOT/tests/fixtures/scripts/hf_trainer.py"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$RES/gpu.txt" 2>&1
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' >>"$RES/gpu.txt" 2>&1

if [[ "${SKIP_JOB:-0}" != 1 ]]; then
say "controller and an NVML agent"
"$BIN/trainyard-controller" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --data-dir "$D/controller" \
    --addr-file "$D/addr" 2>"$RES/controller.log" &
PIDS+=($!)
for _ in $(seq 100); do [[ -s "$D/addr" ]] && break; sleep 0.1; done
URL="http://$(cat "$D/addr")"
CTL=("$BIN/ctl" --controller "$URL")
"$BIN/trainyard-agent" --controller "$URL" --allow-root-ranks --data-dir "$D/agent" \
    --telemetry-window-secs 5 ${AGENT_ARGS:-} 2>"$RES/agent.log" &
PIDS+=($!)
for _ in $(seq 600); do
    [[ "$(sql "SELECT count(*) FROM agents WHERE state = 'connected'" 2>/dev/null)" == "[[1]]" ]] && break
    sleep 0.1
done
"${CTL[@]}" nodes >"$RES/nodes.txt" 2>&1

say "the Trainer run as an exec job: $STEPS steps"
mkdir -p "$D/work"
cat >"$D/job.toml" <<TOML
name = "hf-trainer-unchanged"

[resources]
gpus = 1

[engine]
kind = "exec"
argv = ["$PY", "$SCRIPT", $([[ -n $GPU_FLAG ]] && echo "\"$GPU_FLAG\", ")"--steps", "$STEPS", "--out", "$D/work"]
workdir = "$D/work"

[env]
HF_HUB_OFFLINE = "1"
TRANSFORMERS_OFFLINE = "1"
TOML
JOB="$("${CTL[@]}" submit "$D/job.toml")" || { say "submit failed"; exit 1; }
for _ in $(seq 3000); do
    state="$("${CTL[@]}" status "$JOB" -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
    [[ "$state" == failed || "$state" == succeeded || "$state" == cancelled ]] && break
    sleep 0.2
done
say "job $JOB: $state"
sleep 6  # the last telemetry window
"${CTL[@]}" status "$JOB" >"$RES/status.txt" 2>&1
"${CTL[@]}" status "$JOB" -o json >"$RES/status.json" 2>&1
"${CTL[@]}" diagnose "$JOB" >"$RES/diagnose.txt" 2>&1
"${CTL[@]}" diagnose "$JOB" -o json >"$RES/diagnose.json" 2>&1
"${CTL[@]}" logs "$JOB" --tail 40 >"$RES/rank0-output.txt" 2>&1
cp "$D/work/log_history.json" "$RES/log_history.json" 2>/dev/null
sql "SELECT kind, step, body FROM receipts WHERE job_id = $JOB ORDER BY seq" >"$RES/receipts.json"
sql "SELECT start_ms, end_ms, samples, sm_clock_mean, power_mean, util_mean, clock_reasons, first_step, last_step FROM gpu_samples WHERE job_id = $JOB ORDER BY start_ms" >"$RES/windows.json"

BOOT="$(ls -d "$D"/agent/bootstrap/*/ | head -n 1)"
else
    BOOT="$D/boot"
    mkdir -p "$BOOT"
    cp python/bootstrap/sitecustomize.py "$BOOT/" && cp -r python/trainyard_receipts "$BOOT/"
    [[ "${WARM:-1}" == 1 ]] && say "warm-up run"
    mkdir -p "$D/warm"
    [[ "${WARM:-1}" == 1 ]] && env HF_HUB_OFFLINE=1 "$PY" "$SCRIPT" $GPU_FLAG --steps 20 --out "$D/warm" >"$D/warm/log" 2>&1
fi
say "the bootstrap's cost: the script directly, $PAIRS pairs of $PAIR_STEPS steps, alternating"
for i in $(seq "$PAIRS"); do
    for mode in ${ORDER:-off on}; do
        out="$D/pair-$mode-$i"
        mkdir -p "$out"
        if [[ $mode == on ]]; then
            env PYTHONPATH="$BOOT" TRAINYARD_RECEIPTS="$out/receipts.jsonl" RANK=0 HF_HUB_OFFLINE=1 \
                "$PY" "$SCRIPT" $GPU_FLAG --steps "$PAIR_STEPS" --out "$out" >"$out/log" 2>&1
        else
            # The bootstrap on the path, turned off as `[receipts] auto = false` turns it off.
            env PYTHONPATH="$BOOT" TRAINYARD_RECEIPTS="$out/receipts.jsonl" TRAINYARD_RECEIPTS_AUTO=0 RANK=0 \
                HF_HUB_OFFLINE=1 "$PY" "$SCRIPT" $GPU_FLAG --steps "$PAIR_STEPS" --out "$out" >"$out/log" 2>&1
        fi
        cp "$out/log_history.json" "$RES/pair-$mode-$i.json" 2>/dev/null
        say "pair $i $mode: exit $?"
    done
done
"$PY" deploy/gpu/unchanged_summary.py "$RES" >"$RES/summary.txt" 2>&1
cat "$RES/summary.txt"
say "done"
