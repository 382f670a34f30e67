#!/usr/bin/env bash
# The whole test suite, as CI runs it, from a fresh machine with the Rust toolchain.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# The end-to-end tests in tests/ start the real binaries, so build them first.
bash deploy/setup.sh

echo "test: cargo fmt --all -- --check"
cargo fmt --all -- --check

echo "test: cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

echo "test: cargo test --workspace"
cargo test --workspace

echo "test: all passed"
