#!/usr/bin/env bash
# Prepares this checkout: checks the tools, builds every binary of the workspace.
# Idempotent: run it as often as you like; cargo only rebuilds what changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "setup: $1 is not installed. $2" >&2
        exit 1
    fi
}
need cargo "Install the Rust toolchain (https://rustup.rs), then run this script again."
need python3 "Install Python 3 (e.g. apt-get install python3); the example rank program needs it."

echo "setup: building the workspace binaries (cargo build --workspace --bins)"
cargo build --workspace --bins

# Later: the built-in engine links libtorch from the PyPI torch==2.11.0 wheel, installed into a
# virtual environment made here. Nothing is installed for it yet. The hook will look like:
#   python3 -m venv "$ROOT/.venv"
#   "$ROOT/.venv/bin/pip" install torch==2.11.0
#   export LIBTORCH_USE_PYTORCH=1   # tch-rs finds libtorch inside the venv's torch package

echo "setup: done; binaries are in $ROOT/target/debug"
