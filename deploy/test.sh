#!/usr/bin/env bash
# The whole test suite, as CI runs it, from a fresh machine with the Rust toolchain.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# One full build, not edits in a loop: cargo's incremental caches would only take disk (about as
# much again as the build itself, several GB; a linker that runs out of disk dies with a bus
# error). Set CARGO_INCREMENTAL=1 to keep them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# The end-to-end tests in tests/ start the real binaries, so build them first.
bash deploy/setup.sh

echo "test: cargo fmt --all -- --check"
cargo fmt --all -- --check

echo "test: cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

echo "test: cargo test --workspace"
cargo test --workspace

echo "test: all passed ($(bash deploy/disk.sh))"
