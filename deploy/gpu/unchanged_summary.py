"""What deploy/gpu/unchanged.sh measured, in one page.

    python3 deploy/gpu/unchanged_summary.py RESULTS_DIR

Reads receipts.json (the job's receipts from the store), log_history.json (what Trainer logged),
windows.json (the GPU telemetry windows stored for the job), diagnose.json, status.json and
pair-{off,on}-N.json (Trainer's log of the runs without and with the bootstrap).
"""
import collections
import json
import statistics
import sys
from pathlib import Path


def load(path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def main():
    res = Path(sys.argv[1])
    rows = load(res / "receipts.json", [])
    bodies = [(kind, json.loads(body)) for kind, _, body in rows]
    steps = [b for k, b in bodies if k == "step"]
    kinds = collections.Counter(k for k, _ in bodies)
    print(f"receipts by kind: {dict(kinds)}")
    numbers = [s["step"] for s in steps]
    print(f"step receipts: {len(steps)}, steps {min(numbers, default=None)}..{max(numbers, default=None)}, "
          f"distinct {len(set(numbers))}")
    sources = collections.Counter(s.get("sources", {}).get("step_time_ms") for s in steps)
    fwd = collections.Counter(s.get("sources", {}).get("fwd_bwd_ms") for s in steps)
    print(f"step_time_ms from: {dict(sources)}; fwd_bwd_ms from: {dict(fwd)}")
    timed = [s for s in steps[5:] if "fwd_bwd_ms" in s]
    if timed:
        st = statistics.median(s["step_time_ms"] for s in timed)
        fb = statistics.median(s["fwd_bwd_ms"] for s in timed)
        print(f"median after step 5: step_time_ms {st:.2f}, fwd_bwd_ms {fb:.2f} ({fb / st:.2f} of the step)")
    history = [h for h in load(res / "log_history.json", []) if "loss" in h]
    losses = [s.get("loss") for s in steps]
    same = sum(1 for h in history if 0 <= h["step"] - 1 < len(losses) and losses[h["step"] - 1] == h["loss"])
    print(f"losses equal to what Trainer logged: {same} of {len(history)}; "
          f"loss from: {dict(collections.Counter(s.get('sources', {}).get('loss') for s in steps))}")
    launch = next((b for k, b in bodies if k == "launch"), {})
    print(f"launch: device {launch.get('device')}, torch {launch.get('torch')}, "
          f"bootstrap_hash {str(launch.get('bootstrap_hash'))[:16]}, producer {launch.get('producer')}")
    windows = load(res / "windows.json", [])
    joined = [w for w in windows if w[7] is not None]
    print(f"telemetry windows: {len(windows)}, with the steps they ran: {len(joined)}; "
          f"util mean {statistics.mean(w[5] for w in windows):.0f} %, SM clock mean "
          f"{statistics.mean(w[3] for w in windows):.0f} MHz" if windows else "telemetry windows: none")
    for w in joined[:3]:
        print(f"  window {w[0]}..{w[1]}: steps {w[7]}..{w[8]}, {w[2]} readings, power {w[4]:.0f} W, reasons {w[6]:#x}")
    d = load(res / "diagnose.json", {})
    print(f"diagnose: healthy {d.get('healthy')}, metric {d.get('metric')}, "
          f"findings {[f.get('cause') for f in d.get('findings', [])]}")
    g = (load(res / "status.json", {}) or {}).get("goodput") or {}
    print(f"goodput: {g.get('summary')}")
    per_step = {"off": [], "on": []}
    for path in sorted(res.glob("pair-*.json")):
        mode = path.stem.split("-")[1]
        end = [h for h in load(path, []) if "train_runtime" in h]
        n = max((h.get("step", 0) for h in load(path, [])), default=0)
        if end and n:
            per_step[mode].append(end[0]["train_runtime"] * 1000 / n)
    if per_step["off"] and per_step["on"]:
        off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
        print(f"the script alone, ms a step (Trainer's train_runtime / steps): without the bootstrap "
              f"{[round(x, 2) for x in per_step['off']]}, with {[round(x, 2) for x in per_step['on']]}; "
              f"medians {off:.2f} and {on:.2f}: {on / off:.4f}x")


if __name__ == "__main__":
    main()
