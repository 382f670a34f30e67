#!/usr/bin/env bash
# Tokens/s of the engine and of the PyTorch reference on CPU: same model (d4 by default), same
# optimizer, same data, same threads. Usage: engine/reference/bench.sh [PRESET_DEPTH] [THREADS] [STEPS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
DEPTH="${1:-4}"; THREADS="${2:-2}"; STEPS="${3:-30}"
cargo build --release -q -p trainyard-engine
BIN="$ROOT/target/release/trainyard-engine"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
VOCAB=$("$BIN" tokenize --compact --out "$WORK" engine/corpus/*.txt | sed 's/.*vocab_size //')
ARGS=(--lr-scale 1 --num-iterations "$STEPS" --warmup-steps 5)
TRAINYARD_RECEIPTS="$WORK/r.jsonl" "$BIN" train --device cpu --threads "$THREADS" \
    --preset "d$DEPTH" --seq-len 256 --device-batch-size 8 --total-batch-size 2048 \
    --vocab-size "$VOCAB" --train "$WORK/train_000000.bin" --export-init "$WORK/w.safetensors" "${ARGS[@]}"
.venv/bin/python engine/reference/gpt_ref.py --weights "$WORK/w.safetensors" --depth "$DEPTH" \
    --train "$WORK/train_000000.bin" --threads "$THREADS" --seq-len 256 --device-batch-size 8 \
    --total-batch-size 2048 "${ARGS[@]}" > "$WORK/py.json"
python3 - "$WORK/r.jsonl" "$WORK/py.json" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
dts = [s["step_time_ms"] / 1e3 for s in steps if s["kind"] == "step"][2:]
engine = 2048 * len(dts) / sum(dts)
ref = json.load(open(sys.argv[2]))["tokens_per_s"]
print(f"engine    {engine:10.0f} tokens/s")
print(f"reference {ref:10.0f} tokens/s (PyTorch eager)")
print(f"ratio     {engine / ref:10.3f}")
PY
