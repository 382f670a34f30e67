#!/usr/bin/env bash
# One builtin job through the whole system on a GPU node (called by check.sh):
# controller on SQLite, an agent that describes the host through NVML (no host file), a d12 job
# of one rank on GPU 0 with a `standard` launch preflight and checkpoints; its rank is SIGKILLed
# after the first checkpoint, the restart policy starts attempt 1, which must resume from that
# checkpoint. Prints what the store holds. Usage: cluster.sh BIN_DIR WORK_DIR RESULTS_DIR
set -uo pipefail
BIN=$1 WORK=$2 RES=$3
PY="${PYTHON:-python3}"
D="$WORK/cluster"
mkdir -p "$D"
PIDS=()
cleanup() {
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[i]}" 2>/dev/null; sleep 0.5; kill -KILL "${PIDS[i]}" 2>/dev/null; done
}
trap cleanup EXIT
fail() { echo "cluster: FAILED: $*"; exit 1; }
sql() { "$PY" -c 'import sqlite3,sys,json; c=sqlite3.connect(sys.argv[1]); print(json.dumps(c.execute(sys.argv[2]).fetchall()))' "$D/controller/trainyard.db" "$1"; }

"$BIN/trainyard-controller" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --data-dir "$D/controller" --addr-file "$D/addr" \
    2>"$RES/cluster-controller.log" &
PIDS+=($!)
for _ in $(seq 100); do [[ -s "$D/addr" ]] && break; sleep 0.1; done
[[ -s "$D/addr" ]] || fail "controller did not start"
URL="http://$(cat "$D/addr")"
CTL=("$BIN/ctl" --controller "$URL")
# A loopback demo controller: its jobs name no Unix account, which a root agent refuses unless
# told this is a single-user box.
"$BIN/trainyard-agent" --controller "$URL" --allow-root-ranks --data-dir "$D/agent" 2>"$RES/cluster-agent.log" &
PIDS+=($!)
for _ in $(seq 600); do
    [[ "$(sql "SELECT count(*) FROM agents WHERE state = 'connected'" 2>/dev/null)" == "[[1]]" ]] && break
    sleep 0.1
done
"${CTL[@]}" nodes || fail "no node"
"${CTL[@]}" nodes -o json >"$RES/cluster-nodes.json"

cat >"$D/job.toml" <<TOML
name = "gpu-d12-restart"
preflight = "standard"

[resources]
gpus = 1

[engine]
kind = "builtin"
preset = "d12"
data = "$WORK/shards"

[engine.settings]
device = "cuda"
seq_len = "1024"
device_batch_size = "8"
vocab_size = "50257"
num_iterations = "40"
warmup_steps = "5"
lr_scale = "1"
eval_every = "20"
eval_batches = "2"
checkpoint_every = "10"
checkpoint_dir = "$D/ckpt"

[restart]
max_restarts = 1
resume = true
TOML
JOB="$("${CTL[@]}" submit "$D/job.toml")" || fail "submit"
echo "submitted job $JOB"
# Kill the rank once its first checkpoint is stored.
for _ in $(seq 1800); do
    [[ "$(sql "SELECT count(*) FROM receipts WHERE job_id = $JOB AND kind = 'checkpoint'")" != "[[0]]" ]] && break
    state="$("${CTL[@]}" status "$JOB" -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
    [[ "$state" == failed || "$state" == succeeded ]] && { "${CTL[@]}" status "$JOB"; fail "job ended ($state) before its first checkpoint"; }
    sleep 0.1
done
PID="$("${CTL[@]}" status "$JOB" -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["ranks"][0]["pid"])')"
echo "SIGKILL rank 0 (pid $PID) after its first checkpoint"
kill -KILL "$PID"
for _ in $(seq 3000); do
    state="$("${CTL[@]}" status "$JOB" -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
    [[ "$state" == failed || "$state" == succeeded || "$state" == cancelled ]] && break
    sleep 0.1
done
"${CTL[@]}" status "$JOB"
"${CTL[@]}" status "$JOB" -o json >"$RES/cluster-status.json"
AGENT="$(sql "SELECT agent_id FROM agents" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[0][0])')"
"${CTL[@]}" preflight "$AGENT" >"$RES/cluster-preflight.txt" 2>&1
echo "receipts per attempt and kind:"
sql "SELECT attempt, kind, count(*), min(step), max(step) FROM receipts WHERE job_id = $JOB GROUP BY attempt, kind ORDER BY attempt, kind"
echo "launch receipts (attempt, resumed_from, preflight report, device, binding):"
sql "SELECT attempt, json_extract(body,'\$.resumed_from'), json_extract(body,'\$.env.TRAINYARD_PREFLIGHT_REPORT'), json_extract(body,'\$.device'), json_extract(body,'\$.binding') FROM receipts WHERE job_id = $JOB AND kind = 'launch'"
echo "checkpoints:"
sql "SELECT attempt, step, json_extract(body,'\$.bytes'), json_extract(body,'\$.duration_ms') FROM receipts WHERE job_id = $JOB AND kind = 'checkpoint'"
echo "preflight reports stored (id, agent, level, verdict, nccl):"
sql "SELECT id, agent_id, level, verdict, interconnect_class, driver_version, cuda_version, nccl_version FROM preflight_reports"
cp "$D/controller/trainyard.db" "$RES/cluster-trainyard.db" 2>/dev/null
"$PY" - "$D/controller/trainyard.db" "$JOB" <<'PY'
import json, sqlite3, sys
c = sqlite3.connect(sys.argv[1]); job = int(sys.argv[2])
state = c.execute("SELECT state FROM jobs WHERE id = ?", (job,)).fetchone()
first = c.execute("SELECT min(step) FROM receipts WHERE job_id = ? AND attempt = 1 AND kind = 'step'", (job,)).fetchone()[0]
ckpts = [r[0] for r in c.execute("SELECT step FROM receipts WHERE job_id = ? AND attempt = 0 AND kind = 'checkpoint'", (job,))]
last = c.execute("SELECT max(step) FROM receipts WHERE job_id = ? AND attempt = 1 AND kind = 'step'", (job,)).fetchone()[0]
ok = state and state[0] == "succeeded" and first is not None and (first - 1) in ckpts and last == 40
print(f"cluster verdict: state {state}, attempt 1 first step {first}, attempt 0 checkpoints {ckpts}, last step {last}: {'OK' if ok else 'NOT OK'}")
sys.exit(0 if ok else 1)
PY
