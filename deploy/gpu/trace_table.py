#!/usr/bin/env python3
"""Where a step's GPU time goes, from a Chrome trace of libtorch's profiler (the engine's
--profile-steps, or torch.profiler's export_chrome_trace): GPU time per step by kernel, and by
the op that launched it (the innermost CPU op, joined on the trace's "External id"), and by that
op with its input shapes.

usage: trace_table.py TRACE.json STEPS [--top N]
"""
import argparse
import collections
import json

GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("steps", type=int, help="how many steps the trace covers")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ops, shapes = {}, {}
    for e in events:
        if e.get("cat") == "cpu_op":
            args = e.get("args") or {}
            ext = args.get("External id")
            if ext is not None:
                ops[ext] = e["name"]
                shapes[ext] = f'{e["name"]} {args.get("Input Dims", "")}'[:140]
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_op = collections.defaultdict(lambda: [0.0, 0])
    by_shape = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    for e in events:
        if e.get("cat") not in GPU:
            continue
        dur = float(e.get("dur", 0))
        total += dur
        k = by_kernel[e["name"][:110]]
        k[0] += dur
        k[1] += 1
        ext = (e.get("args") or {}).get("External id")
        for table, key in ((by_op, ops.get(ext, "(no op)")), (by_shape, shapes.get(ext, "(no op)"))):
            table[key][0] += dur
            table[key][1] += 1
    n = a.steps
    if total == 0:
        raise SystemExit(f"{a.trace}: no GPU kernels, copies or sets in the trace (a CPU run?)")
    print(f"# {a.trace}: {n} steps, GPU busy {total / n / 1e3:.2f} ms per step (kernels, copies, sets)")
    for title, table in (("kernel", by_kernel), ("launching op", by_op), ("launching op and its input shapes", by_shape)):
        print(f"\n## by {title}: ms per step, share, launches per step")
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])
        for name, (dur, count) in rows[: a.top]:
            print(f"{dur / n / 1e3:9.3f} {100 * dur / total:5.1f}% {count / n:7.1f}  {name}")
        rest = sum(d for _, (d, _) in rows[a.top:])
        if rest:
            print(f"{rest / n / 1e3:9.3f} {100 * rest / total:5.1f}%          ({len(rows) - a.top} more)")


if __name__ == "__main__":
    main()
