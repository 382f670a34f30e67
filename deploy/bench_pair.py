#!/usr/bin/env python3
"""Runs one committed bench on two checkouts of trainyard, alternating, and writes every run's
output as one JSON line of a result file (docs/results/): the before/after comparison a
restructuring owes ("same bench, same machine, same hour, medians of alternating runs").

    deploy/bench_pair.py --before DIR --after DIR [--runs 3] --name NAME [--out DIR] \
        -- cargo bench -p trainyard-placement --bench schedule

Each checkout builds in its own target directory (DIR/target), so switching costs nothing
after the first build. Run i goes before-then-after when i is even and after-then-before when
odd, so neither side always runs first. A line holds the bench, its arguments, the checkout
(commit, whether its tree was dirty), the date, the machine (cores, CPU model, memory, disk,
kernel), the run's wall time and the bench's own output (its last 8 KiB): the figures are the
bench's, read from its output, never retyped.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time


def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    mem_gib = 0.0
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(l.split()[1]) for l in f if l.startswith("MemTotal"))
            mem_gib = round(kb / 1024 / 1024, 1)
    except (OSError, StopIteration):
        pass
    disk = shutil.disk_usage("/")
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": mem_gib,
        "disk_gib": round(disk.total / 2**30),
        "kernel": platform.release(),
    }


def checkout(path):
    git = lambda *a: subprocess.run(["git", "-C", path, *a], capture_output=True, text=True).stdout.strip()
    return {"dir": path, "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def run(tree, command, timeout):
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(tree, "target"))
    started = time.monotonic()
    p = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    out = (p.stdout + p.stderr)[-8192:]
    return p.returncode, wall, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        sys.exit("bench_pair: give the bench's command after --")
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    facts = {side: checkout(path) for side, path in trees.items()}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.name}-{stamp}.jsonl")
    print(f"bench_pair: builds first (each checkout once), then {a.runs} alternating runs -> {path}", flush=True)
    for side in ("before", "after"):
        build = command[:2] + ["--no-run"] + command[2:] if command[:2] == ["cargo", "bench"] else ["true"]
        if "--" in build:
            build = build[: build.index("--")]
        code, wall, out = run(trees[side], build, a.timeout)
        print(f"bench_pair: {side} built in {wall:.0f} s (exit {code})", flush=True)
        if code != 0:
            sys.exit(f"bench_pair: the {side} build failed:\n{out}")
    with open(path, "w") as f:
        for i in range(a.runs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                code, wall, out = run(trees[side], command, a.timeout)
                line = {
                    "bench": a.name,
                    "command": command,
                    "side": side,
                    "checkout": facts[side],
                    "run": i,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(),
                    "exit": code,
                    "wall_s": round(wall, 1),
                    "output": out,
                }
                f.write(json.dumps(line) + "\n")
                f.flush()
                print(f"bench_pair: run {i} {side}: exit {code}, {wall:.0f} s", flush=True)
    print(path)


if __name__ == "__main__":
    main()
