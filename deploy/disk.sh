#!/usr/bin/env bash
# What this checkout's builds take on disk, and what is left there, on one line:
#   target/ 5.1 GiB, .venv 4.7 GiB, 40.2 GiB free
# With --room GIB it exits 1 (after the line) when target/ and .venv cannot grow to GIB in all:
# when what they take now plus what is free is less than GIB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

gib() { awk -v k="$1" 'BEGIN { printf "%.1f GiB", k / 1048576 }'; }
size() { if [ -e "$1" ]; then du -sk "$1" 2>/dev/null | cut -f1; else echo 0; fi; }

target_k="$(size "$ROOT/target")"
venv_k="$(size "$ROOT/.venv")"
free_k="$(df -Pk "$ROOT" | awk 'NR == 2 { print $4 }')"
echo "target/ $(gib "$target_k"), .venv $(gib "$venv_k"), $(gib "$free_k") free"
if [ "${1:-}" = "--room" ]; then
    awk -v k="$((target_k + venv_k + free_k))" -v room="$2" 'BEGIN { exit !(k / 1048576 >= room) }'
fi
