#!/usr/bin/env python3
"""Writes step receipts as fast as it can, each stamped with its write time (for benchmarks).

Usage: flood.py --receipts N [--chunk K] [--rate R]. Lines go out in chunks of K (one write
each), the way a fast training loop's receipts would pile up, as fast as possible or at R
receipts per second; `t_ms` is the wall-clock time of the chunk's
write, so `receipts.stored_at_ms - t_ms` is the rank-to-SQL latency of every receipt.
"""

import argparse
import json
import os
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receipts", type=int, default=100_000)
    p.add_argument("--chunk", type=int, default=500)
    p.add_argument("--rate", type=float, default=0.0, help="receipts per second (0: as fast as possible)")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    path = os.environ.get("TRAINYARD_RECEIPTS", "receipts.jsonl")
    pad = "x" * 120  # brings a receipt to ~300 bytes, like a real step receipt
    started = time.monotonic()
    with open(path, "ab") as f:
        step = 0
        while step < args.receipts:
            if args.rate > 0:
                due = started + step / args.rate
                time.sleep(max(0.0, due - time.monotonic()))
            t_ms = int(time.time() * 1000)
            n = min(args.chunk, args.receipts - step)
            lines = []
            for s in range(step, step + n):
                body = {"kind": "step", "step": s, "rank": rank, "t_ms": t_ms, "loss": 3.14159,
                        "step_time_ms": 1.0, "tokens_per_s": 1e6, "pad": pad}
                lines.append(json.dumps(body, separators=(",", ":")))
            f.write(("\n".join(lines) + "\n").encode())
            f.flush()
            step += n
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
