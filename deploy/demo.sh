#!/usr/bin/env bash
# The trainyard demo on one machine, no GPU needed:
#   a controller on embedded SQLite, two agents standing in for 8xH100 SXM nodes (GPU telemetry
#   replayed from deploy/hosts/demo-telemetry.json in 2-s windows), a 16-rank job of
#   examples/rank.py (deploy/demo-job.toml: 480 steps of 75 ms, about 40 s, with loss, tokens/s
#   and MFU), its status, and its receipts read straight from SQL.
# Everything it starts is stopped when it exits (Ctrl-C included). Each run keeps its files in
# demo-data/<time>/.
#
# After the job, in a terminal (stdin a terminal), the controller and its web view stay up
# until you press Enter; run without a terminal (CI, a pipe), it stops everything when the job
# ends and does not invite you to open the web view, saying only where the database is.
#
#   ./deploy/demo.sh          the 16-rank job of examples/rank.py
#   ./deploy/demo.sh gpt      a built-in engine job instead: a d4 GPT trained on the corpus
#                             shipped in engine/corpus, one CPU rank on each node (ZeRO-2 over TCP)
#   ./deploy/demo.sh --keep   (with either) leaves the cluster running after the job until
#                             Ctrl-C, terminal or not, to open the web view, `ctl diagnose` and
#                             the tables, and to submit more jobs
#   ./deploy/demo.sh --run-ranks-as-root
#                             as root only: run the demo's ranks as root (without it, the demo
#                             refuses to start as root). Its controller answers calls without a
#                             token only from the account that started it, whoever else is on
#                             the machine (docs/security.md, "Modes").
set -euo pipefail

MODE=ranks
KEEP=0
RANKS_AS_ROOT=0
for arg in "$@"; do
    case "$arg" in
        gpt) MODE=gpt ;;
        --keep) KEEP=1 ;;
        --run-ranks-as-root) RANKS_AS_ROOT=1 ;;
        *)
            echo "usage: $0 [gpt] [--keep] [--run-ranks-as-root]" >&2
            exit 2
            ;;
    esac
done
if [ "$(id -u)" = 0 ] && [ "$RANKS_AS_ROOT" != 1 ]; then
    cat >&2 <<'EOF_ROOT'
deploy/demo.sh is running as root, so the demo's ranks (its jobs' programs) would run as root.
Run it as an ordinary user, or pass --run-ranks-as-root to say that every rank of this demo
may run as root on this machine.
EOF_ROOT
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '\n==> %s\n' "$*"; }

PIDS=()
JOB=""
JOB_FILE=""
URL=""
CTL="$ROOT/target/debug/ctl"

# What happens after the job: "keep" (--keep: until Ctrl-C), "enter" (stdin is a terminal: until
# the user presses Enter) or "stop" (no terminal: everything stops when the job ends).
if ((KEEP == 1)); then
    AFTER=keep
elif [[ -t 0 ]]; then
    AFTER=enter
else
    AFTER=stop
fi

cleanup() {
    local rc=$?
    set +e
    # Interrupted while `ctl submit --follow` ran: the job id it printed first is in its file.
    if [[ -z "$JOB" && -n "$JOB_FILE" && -s "$JOB_FILE" ]]; then
        JOB="$(head -n 1 "$JOB_FILE")"
    fi
    if [[ -n "$JOB" && -n "$URL" ]]; then
        state="$("$CTL" --controller "$URL" status "$JOB" -o json 2>/dev/null |
            python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null)"
        case "$state" in
            succeeded | failed | cancelled | "") ;;
            *)
                say "Cancelling job $JOB (still $state) so no rank outlives the demo"
                "$CTL" --controller "$URL" cancel "$JOB"
                ;;
        esac
    fi
    if ((${#PIDS[@]})); then
        say "Stopping the agents and the controller"
        # Agents first (in reverse start order), so they leave cleanly while the controller is up.
        for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
            kill -TERM "${PIDS[i]}" 2>/dev/null
            for _ in $(seq 50); do
                kill -0 "${PIDS[i]}" 2>/dev/null || break
                sleep 0.1
            done
            kill -KILL "${PIDS[i]}" 2>/dev/null
            wait "${PIDS[i]}" 2>/dev/null
        done
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "Building trainyard (deploy/setup.sh)"
bash deploy/setup.sh

DATA="$ROOT/demo-data/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$DATA"
say "This run's files (database, logs, receipts files) go to $DATA"

say "Starting the controller on embedded SQLite, on a free port"
"$ROOT/target/debug/trainyard-controller" --listen 127.0.0.1:0 --data-dir "$DATA/controller" \
    --addr-file "$DATA/controller.addr" --http-listen 127.0.0.1:0 --http-addr-file "$DATA/controller.http" \
    2>"$DATA/controller.log" &
PIDS+=($!)
for _ in $(seq 300); do
    [[ -s "$DATA/controller.addr" ]] && break
    if ! kill -0 "${PIDS[0]}" 2>/dev/null; then
        echo "the controller exited at start; its log ($DATA/controller.log) ends with:" >&2
        tail -n 20 "$DATA/controller.log" >&2
        exit 1
    fi
    sleep 0.1
done
if [[ ! -s "$DATA/controller.addr" ]]; then
    echo "the controller did not report its address within 30 s; see $DATA/controller.log" >&2
    exit 1
fi
URL="http://$(cat "$DATA/controller.addr")"
export TRAINYARD_CONTROLLER="$URL"
for _ in $(seq 100); do
    [[ -s "$DATA/controller.http" ]] && break
    sleep 0.1
done
if [[ ! -s "$DATA/controller.http" ]]; then
    echo "the controller did not report its web view's address within 10 s; see $DATA/controller.log" >&2
    exit 1
fi
WEB="http://$(cat "$DATA/controller.http")/"
echo "controller listening at $URL; database $DATA/controller/trainyard.db"
case "$AFTER" in
    keep) echo "web view at $WEB (jobs, plots, diagnosis, nodes): it stays up after the job until Ctrl-C (--keep)" ;;
    enter) echo "web view at $WEB (jobs, plots, diagnosis, nodes): watch the job live; it stays up after the job until you press Enter" ;;
    *) echo "web view at $WEB only while the job runs: stdin is not a terminal, so the demo stops everything when the job ends (run it in a terminal, or with --keep, to keep it up)" ;;
esac

# The demo's jobs belong to the local admin, who has no Unix account mapping: an agent running
# as root refuses such launches unless told to run them as root, which the operator asked for
# in words (--run-ranks-as-root) to get here as root (docs/security.md).
AGENT_FLAGS=()
if [ "$(id -u)" = 0 ]; then
    echo "--run-ranks-as-root: the demo's ranks run as root on this machine" >&2
    AGENT_FLAGS+=(--allow-root-ranks)
fi
for node in a b; do
    say "Starting agent demo-node-$node (8 stand-in H100 SXM GPUs from deploy/hosts/demo-node-$node.json, telemetry replayed from deploy/hosts/demo-telemetry.json)"
    "$ROOT/target/debug/trainyard-agent" --controller "$URL" "${AGENT_FLAGS[@]}" \
        --host-file "$ROOT/deploy/hosts/demo-node-$node.json" --data-dir "$DATA/node-$node" \
        --telemetry "script:$ROOT/deploy/hosts/demo-telemetry.json" --telemetry-window-secs 2 \
        2>"$DATA/agent-$node.log" &
    PIDS+=($!)
done

say "Waiting for both agents to say hello to the controller"
# The controller refuses a job the connected fleet cannot hold, so wait for the agents first.
# The agents table is the operator's interface: read it like an operator would.
DB="$DATA/controller/trainyard.db"
connected=0
for _ in $(seq 300); do
    connected="$(python3 - "$DB" <<'PY'
import sqlite3, sys
try:
    con = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True, timeout=1)
    print(con.execute("SELECT count(*) FROM agents WHERE state = 'connected'").fetchone()[0])
except sqlite3.Error:
    print(0)
PY
)"
    ((connected >= 2)) && break
    for i in 1 2; do
        if ! kill -0 "${PIDS[i]}" 2>/dev/null; then
            node=$([[ $i == 1 ]] && echo a || echo b)
            echo "agent demo-node-$node exited at start; its log ($DATA/agent-$node.log) ends with:" >&2
            tail -n 20 "$DATA/agent-$node.log" >&2
            exit 1
        fi
    done
    sleep 0.1
done
if ((connected < 2)); then
    echo "only $connected of 2 agents connected within 30 s; see $DATA/agent-*.log" >&2
    exit 1
fi
echo "2 agents connected: 16 GPUs"

if [[ "$MODE" == gpt ]]; then
    say "Tokenizing engine/corpus into token shards (GPT-2 BPE, ids renumbered densely)"
    "$ROOT/target/debug/trainyard-engine" tokenize --compact --out "$DATA/shards" "$ROOT"/engine/corpus/*.txt
    VOCAB="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$DATA/shards/vocab.json")"
    say "Submitting a built-in engine job: d4 GPT, 2 ranks (one per node), 60 steps, eval every 20"
    cat >"$DATA/demo-job.toml" <<SPEC
name = "demo-gpt"
[resources]
gpus = 2
gpus_per_node = 1
[engine]
kind = "builtin"
preset = "d4"
data = "$DATA/shards"
[engine.settings]
vocab_size = "$VOCAB"
seq_len = "64"
device_batch_size = "4"
num_iterations = "60"
warmup_steps = "5"
eval_every = "20"
lr_scale = "1"
threads = "1"
device = "cpu"
checkpoint_every = "30"
checkpoint_dir = "$DATA/checkpoints"
SPEC
else
    say "Submitting deploy/demo-job.toml: 16 ranks, 8 per node, 480 steps of 75 ms of examples/rank.py (about 40 s)"
    # The workdir must be absolute: write this checkout's path into a copy of the spec.
    sed "s|^workdir = .*|workdir = \"$ROOT\"|" deploy/demo-job.toml >"$DATA/demo-job.toml"
fi
# ctl prints the job id on stdout first, then follows the job on stderr: the id goes to a file,
# so a Ctrl-C while the job runs still finds the job to cancel (cleanup).
JOB_FILE="$DATA/job.id"
set +e
"$CTL" submit --follow "$DATA/demo-job.toml" >"$JOB_FILE"
follow_rc=$?
set -e
JOB="$(head -n 1 "$JOB_FILE")"
if [[ -z "$JOB" ]]; then
    echo "the job was not submitted (see the message above)" >&2
    exit 1
fi

say "Job $JOB as the controller sees it (ctl status $JOB)"
"$CTL" status "$JOB"

SQL="SELECT rank, sum(kind = 'launch') AS launch, sum(kind = 'step') AS step,
        sum(kind = 'exit') AS exit, count(*) AS total
     FROM receipts WHERE job_id = $JOB GROUP BY rank ORDER BY rank;"
say "Receipts per rank and kind, straight from SQLite ($DB)"
if command -v sqlite3 >/dev/null 2>&1; then
    sqlite3 -header -column "$DB" "$SQL"
else
    python3 - "$DB" "$SQL" <<'PY'
import sqlite3, sys
con = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
cur = con.execute(sys.argv[2])
print("  ".join(f"{d[0]:>6}" for d in cur.description))
for row in cur:
    print("  ".join(f"{v:>6}" for v in row))
PY
fi

if [[ "$MODE" == gpt ]]; then
    say "Validation loss as the model trained (eval receipts of rank 0)"
    python3 - "$DB" "$JOB" <<'PY'
import sqlite3, sys
con = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
rows = con.execute(
    "SELECT step, json_extract(body, '$.val_loss') FROM receipts "
    "WHERE job_id = ? AND rank = 0 AND kind = 'eval' ORDER BY step", (int(sys.argv[2]),)).fetchall()
for step, loss in rows:
    print(f"  step {step:>4}  val_loss {loss:.4f}")
PY
fi

say "Query it yourself, e.g. the loss curve of rank 0"
echo "  sqlite3 $DB \\"
echo "    \"SELECT step, json_extract(body,'\$.loss') FROM receipts WHERE job_id=$JOB AND rank=0 AND kind='step' ORDER BY step;\""

if ((follow_rc != 0)); then
    echo "job $JOB did not succeed; logs: $DATA/*.log, rank output: $DATA/node-*/runs/job-$JOB/" >&2
else
    say "Demo done: job $JOB succeeded"
fi

case "$AFTER" in
    stop)
        # No terminal to wait on: everything stops now (cleanup), so no address to open.
        say "The run is over: the agents and the controller stop now"
        echo "  its database stays at $DB, its logs and rank output in $DATA"
        echo "  (run ./deploy/demo.sh in a terminal, or with --keep, to browse the web view after the job)"
        exit "$follow_rc"
        ;;
    enter)
        say "The web view stays up at $WEB until you press Enter (job $JOB: ${WEB}jobs/$JOB)"
        echo "  meanwhile, in another shell: export TRAINYARD_CONTROLLER=$URL (ctl is $CTL)"
        echo "  ctl diagnose $JOB, ctl status $JOB, ctl nodes, ctl logs $JOB --rank 0"
        # Forget what was typed while the job ran: only an Enter pressed from now on stops it.
        while read -r -t 0.05 _; do :; done
        read -r _ || true # Enter, or end of input (Ctrl-D); Ctrl-C stops it too (trap)
        exit "$follow_rc"
        ;;
    keep)
        say "The web view stays up at $WEB until you press Ctrl-C (--keep; job $JOB: ${WEB}jobs/$JOB)"
        echo "  meanwhile, in another shell: export TRAINYARD_CONTROLLER=$URL (ctl is $CTL)"
        echo "  ctl diagnose $JOB, ctl status $JOB, ctl nodes, ctl logs $JOB --rank 0"
        if [[ "$MODE" == ranks ]]; then
            echo "  ctl submit $DATA/demo-job.toml submits the job again"
        fi
        while true; do
            sleep 1
        done
        ;;
esac
