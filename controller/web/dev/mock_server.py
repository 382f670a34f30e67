#!/usr/bin/env python3
"""A stand-in for the controller's web endpoints, to work on controller/web/ without the
controller: serves the static files at the paths the controller serves them and answers the
JSON API (docs in controller/web/dev/README.md) from fixtures.

    python3 controller/web/dev/mock_server.py [--port 8765] [--token SECRET] [--delay-ms 0]

Standard library only (Python 3.11). The fixtures include a running job (7) with 64 ranks
whose step times are synthesized for 100,000 steps (one slow rank, a few spikes) and
downsampled per request like the real endpoint: `buckets` buckets of [first step, min, max,
mean] over [from, to].
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import threading
import time
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

WEB = Path(__file__).resolve().parent.parent  # controller/web

STATIC = {
    **{f"/assets/{name}": (name, "text/javascript; charset=utf-8")
       for name in ("app.js", "common.js", "plots.js", "jobs.js", "nodes.js", "compare.js")},
    "/assets/style.css": ("style.css", "text/css; charset=utf-8"),
    "/assets/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/assets/uplot.min.css": ("vendor/uplot.min.css", "text/css; charset=utf-8"),
}
PAGE = re.compile(r"^/(?:|nodes|compare|jobs/\d+)$")

START_MS = int(time.time() * 1000)
MIN = 60_000
HOUR = 60 * MIN

# ---------------------------------------------------------------------------------- fixtures

SXM = [f"sxm-{c}" for c in "abcdefgh"]
H100 = "NVIDIA H100 80GB HBM3"


def cpus_for(gpu: int, per_gpu: int = 12) -> str:
    lo = gpu * per_gpu
    return f"{lo}-{lo + per_gpu - 1}"


def rank_rows(nodes: list[str], per_node: int, state: str = "running", numa_split_node: str | None = None,
              exit_codes: dict[int, int] | None = None, messages: dict[int, str] | None = None) -> list[dict]:
    rows = []
    for ni, node in enumerate(nodes):
        for g in range(per_node):
            r = ni * per_node + g
            numa = 0 if node == numa_split_node else (0 if g < per_node // 2 else 1)
            code = (exit_codes or {}).get(r)
            rows.append({
                "rank": r, "agent_id": node, "gpu_index": g, "numa_node": numa,
                "cpus": cpus_for(g if node != numa_split_node else g % 4),
                "state": state if code is None else "exited",
                "pid": None if state == "planned" else 20_000 + r * 7,
                "exit_code": code,
                "message": (messages or {}).get(r, ""),
            })
    return rows


NUMA_SPLIT_FINDING = {
    "cause": "numa.split",
    "summary": "sxm-e's ranks run 1.31x slower than the job's median; its GPUs 0-7 span NUMA nodes 0 and 1 "
               "but every rank there is bound to NUMA node 0",
    "nodes": ["sxm-e"],
    "ranks": list(range(32, 40)),
    "expected_cost": "about 24% of every step on the whole job (collectives wait for the slowest node)",
    "remedy": "let the agent bind each rank to its GPU's NUMA node (placement.numa = \"gpu\"), or restart the "
              "agent on sxm-e after fixing its hwloc topology",
    "evidence": [
        {"name": "slowdown", "value": 1.31, "unit": "x"},
        {"name": "cross-NUMA ranks", "value": 4, "unit": "ranks"},
        {"name": "p50 step time there", "value": 551.2, "unit": "ms"},
    ],
}
STRAGGLER_FINDING = {
    "cause": "straggler.unexplained",
    "summary": "rank 37 is 1.42x slower than the job's median, steadily, with nothing else to explain it",
    "nodes": ["sxm-e"],
    "ranks": [37],
    "expected_cost": "about 30% of every step",
    "remedy": "check GPU 5 of sxm-e (clocks, ECC errors: nvidia-smi -q -i 5); exclude the node with "
              "ctl drain sxm-e if it persists",
    "evidence": [{"name": "slowdown", "value": 1.42, "unit": "x"}, {"name": "steps observed", "value": 100000, "unit": ""}],
}
SHM_FINDING = {
    "cause": "shm.disabled",
    "summary": "NCCL_SHM_DISABLE=1: intra-node traffic goes over the network transport",
    "nodes": ["sxm-c"],
    "ranks": list(range(8)),
    "expected_cost": "1.8x step time on this 8-GPU node",
    "remedy": "drop NCCL_SHM_DISABLE from the job's env",
    "evidence": [{"name": "slowdown", "value": 1.8, "unit": "x"}, {"name": "allreduce busbw", "value": 41.5, "unit": "GB/s"}],
}

LOG_TAIL = "\n".join(
    [f"[rank0] step {99_980 + i:>6} | loss 2.4{i % 10}1 | 426.{i % 9} ms | 1,203,{400 + i} tok/s" for i in range(18)]
    + [
        "[rank0] checkpoint: wrote /ckpt/d64/step_100000 (12.4 GB) in 8.1 s",
        "[rank0] warning: <script>alert('log text is escaped')</script> & friends",
        "[rank0] step 100000 | loss 2.398 | 427.0 ms | 1,201,332 tok/s",
    ])


def job(id, name, state, user, gpus, nodes, created_ago_ms, updated_ago_ms, attempt, step, total_steps,
        goodput, reason, *, ranks, metrics, events, diagnosis=None, logs=None, spec="exec python train.py",
        wall_ms=None, parts=None, series=None):
    return {
        "id": id, "name": name, "state": state, "user": user, "gpus": gpus, "nodes": nodes,
        "created_ago_ms": created_ago_ms, "updated_ago_ms": updated_ago_ms, "attempt": attempt,
        "step": step, "total_steps": total_steps, "goodput": goodput, "reason": reason,
        "ranks": ranks, "metrics": metrics, "events": events, "diagnosis": diagnosis, "logs": logs,
        "spec_summary": spec, "wall_ms": wall_ms, "parts": parts, "series": series or {},
    }


def ev(ago_ms, state, reason, attempt=1):
    return {"ago_ms": ago_ms, "state": state, "reason": reason, "attempt": attempt}


def standard_events(start_ago, running_reason="all ranks running", attempt=1):
    return [
        ev(start_ago, "pending", "submitted by ctl", attempt),
        ev(start_ago - 800, "scheduled", "placed", attempt),
        ev(start_ago - 2_100, "launching", "preflight passed", attempt),
        ev(start_ago - 9_500, "running", running_reason, attempt),
    ]


METRICS = ["step_ms", "loss", "tokens_per_s", "mfu"]

JOBS = [
    job(9, "scheduled-probe", "scheduled", "erin", 8, ["sxm-h"], 20_000, 5_000, 1, 0, 500, None, "placed on sxm-h",
        ranks=rank_rows(["sxm-h"], 8, state="planned"), metrics=["step_ms"],
        events=standard_events(20_000)[:2]),
    job(8, "ft-restart-demo", "restarting", "bob", 16, ["sxm-f", "sxm-g"], 3 * HOUR, 40_000, 2, 3_100, None, 0.83,
        "rank 11 lost: agent sxm-g disconnected", ranks=rank_rows(["sxm-f", "sxm-g"], 8, state="lost"),
        metrics=["step_ms", "loss"], events=standard_events(3 * HOUR) + [
            ev(50_000, "restarting", "rank 11 lost: agent sxm-g disconnected", 1)],
        series={"steps": 3_100, "base": 300.0}, wall_ms=3 * HOUR,
        parts=[{"name": "training", "ms": int(0.83 * 3 * HOUR)}, {"name": "startup", "ms": 300_000},
               {"name": "restart", "ms": int(0.17 * 3 * HOUR) - 300_000}]),
    job(7, "d64-pretrain", "running", "alice", 64, SXM, 13 * HOUR, 4_000, 1, 100_000, 150_000, 0.962,
        "all ranks running", ranks=rank_rows(SXM, 8, numa_split_node="sxm-e"), metrics=METRICS,
        events=standard_events(13 * HOUR),
        diagnosis={"verdict": "unhealthy: 2 findings; the job runs about 1.3x slower than it should", "healthy": False,
                   "stragglers": list(range(32, 40)), "findings": [NUMA_SPLIT_FINDING, STRAGGLER_FINDING]},
        logs={"rank": 0, "text": LOG_TAIL}, spec="exec torchrun --nproc-per-node 8 pretrain.py --config d64.yaml",
        series={"steps": 100_000, "base": 420.0, "slow_rank": 37, "slow_node_ranks": range(32, 40)},
        wall_ms=13 * HOUR,
        parts=[{"name": "training", "ms": int(0.962 * 13 * HOUR)}, {"name": "startup", "ms": 410_000},
               {"name": "checkpoint", "ms": 850_000}, {"name": "eval", "ms": int(0.038 * 13 * HOUR) - 1_260_000}]),
    job(6, "eval-nightly", "cancelled", "dave", 4, ["sxm-d"], 26 * HOUR, 25 * HOUR, 1, 1_204, 4_000, 0.88,
        "cancelled by dave", ranks=rank_rows(["sxm-d"], 4, state="exited", exit_codes={r: -15 for r in range(4)},
                                            messages={r: "signal 15 (SIGTERM)" for r in range(4)}),
        metrics=["step_ms", "loss"], events=standard_events(26 * HOUR) + [ev(25 * HOUR, "cancelled", "cancelled by dave")],
        series={"steps": 1_204, "base": 95.0}, wall_ms=HOUR, parts=[{"name": "training", "ms": int(0.88 * HOUR)}, {"name": "startup", "ms": int(0.12 * HOUR)}]),
    job(5, "lr-sweep-3", "failed", "carol", 8, ["sxm-b"], 5 * HOUR, 4 * HOUR, 3, 830, 20_000, 0.71,
        "rank 3 exited with code 1", ranks=rank_rows(["sxm-b"], 8, state="exited", exit_codes={**{r: -15 for r in range(8)}, 3: 1},
                                                    messages={3: "RuntimeError: CUDA error: an illegal memory access was encountered"}),
        metrics=["step_ms", "loss"], events=standard_events(5 * HOUR) + [ev(4 * HOUR, "failed", "rank 3 exited with code 1", 3)],
        logs={"rank": 0, "text": "Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n    loss.backward()\nRuntimeError: CUDA error: an illegal memory access was encountered"},
        series={"steps": 830, "base": 180.0}, wall_ms=HOUR,
        parts=[{"name": "training", "ms": int(0.71 * HOUR)}, {"name": "startup", "ms": int(0.09 * HOUR)}, {"name": "restart", "ms": int(0.2 * HOUR)}]),
    job(4, "<img src=x onerror=alert(1)> & \"quoted\" name", "pending", "mallory", 8, [], 90_000, 90_000, 1, 0, None, None,
        "waiting for 8 free GPUs", ranks=[], metrics=["step_ms", "loss"], events=[ev(90_000, "pending", "submitted by ctl")]),
    job(3, "d12-run", "running", "bob", 16, ["sxm-a", "sxm-b"], 40 * MIN, 3_000, 1, 1_200, 10_000, 0.93,
        "all ranks running", ranks=rank_rows(["sxm-a", "sxm-b"], 8), metrics=METRICS, events=standard_events(40 * MIN),
        diagnosis={"verdict": "healthy: no finding", "healthy": True, "stragglers": [], "findings": []},
        logs={"rank": 0, "text": "step 1199 | loss 3.912\nstep 1200 | loss 3.907"},
        series={"steps": 1_200, "base": 210.0, "grow_per_s": 2}, wall_ms=40 * MIN,
        parts=[{"name": "training", "ms": int(0.93 * 40 * MIN)}, {"name": "startup", "ms": int(0.05 * 40 * MIN)}, {"name": "eval", "ms": int(0.02 * 40 * MIN)}]),
    job(2, "d8-baseline-shm-off", "succeeded", "alice", 8, ["sxm-c"], 30 * HOUR, 28 * HOUR, 1, 5_000, 5_000, 0.91,
        "all ranks exited 0", ranks=rank_rows(["sxm-c"], 8, state="exited", exit_codes={r: 0 for r in range(8)}),
        metrics=["step_ms", "loss", "tokens_per_s"], events=standard_events(30 * HOUR) + [ev(28 * HOUR, "succeeded", "all ranks exited 0")],
        diagnosis={"verdict": "unhealthy: 1 finding", "healthy": False, "stragglers": [], "findings": [SHM_FINDING]},
        spec="exec python train.py --config d8.yaml", series={"steps": 5_000, "base": 180.0 * 1.8},
        wall_ms=2 * HOUR, parts=[{"name": "training", "ms": int(0.91 * 2 * HOUR)}, {"name": "startup", "ms": int(0.09 * 2 * HOUR)}]),
    job(1, "d8-baseline", "succeeded", "alice", 8, ["sxm-a"], 32 * HOUR, 31 * HOUR, 1, 5_000, 5_000, 0.94,
        "all ranks exited 0", ranks=rank_rows(["sxm-a"], 8, state="exited", exit_codes={r: 0 for r in range(8)}),
        metrics=["step_ms", "loss", "tokens_per_s"], events=standard_events(32 * HOUR) + [ev(31 * HOUR, "succeeded", "all ranks exited 0")],
        diagnosis={"verdict": "healthy: no finding", "healthy": True, "stragglers": [], "findings": []},
        spec="exec python train.py --config d8.yaml", series={"steps": 5_000, "base": 180.0},
        wall_ms=HOUR, parts=[{"name": "training", "ms": int(0.94 * HOUR)}, {"name": "startup", "ms": int(0.06 * HOUR)}]),
]
JOBS_BY_ID = {j["id"]: j for j in JOBS}


def current_step(j: dict, now: int) -> int:
    """A running job with grow_per_s in its series config moves on while the mock runs."""
    cfg = j.get("series") or {}
    grow = cfg.get("grow_per_s", 0)
    if not grow:
        return j["step"]
    return min(j["step"] + int((now - START_MS) / 1000 * grow), cfg["steps"] + int(grow * 3600))


def job_list_entry(j: dict, now: int) -> dict:
    return {
        "id": j["id"], "name": j["name"], "state": j["state"], "user": j["user"], "gpus": j["gpus"],
        "nodes": j["nodes"], "created_at_ms": now - j["created_ago_ms"], "updated_at_ms": now - j["updated_ago_ms"],
        "attempt": j["attempt"], "step": current_step(j, now), "total_steps": j["total_steps"], "goodput": j["goodput"],
        "reason": j["reason"],
    }


def job_detail(j: dict, now: int) -> dict:
    goodput = None
    if j["goodput"] is not None and j["wall_ms"]:
        goodput = {"fraction": j["goodput"], "wall_ms": j["wall_ms"], "parts": j["parts"] or []}
    return {
        "id": j["id"], "name": j["name"], "state": j["state"], "user": j["user"], "gpus": j["gpus"],
        "attempt": j["attempt"], "created_at_ms": now - j["created_ago_ms"], "updated_at_ms": now - j["updated_ago_ms"],
        "reason": j["reason"], "step": current_step(j, now), "total_steps": j["total_steps"], "spec_summary": j["spec_summary"],
        "goodput": goodput,
        "events": [{"at_ms": now - e["ago_ms"], "state": e["state"], "reason": e["reason"], "attempt": e["attempt"]}
                   for e in j["events"]],
        "ranks": j["ranks"], "diagnosis": j["diagnosis"], "logs": j["logs"], "metrics": j["metrics"],
    }


def nvswitch_matrix(n=8):
    labels = [f"GPU{i}" for i in range(n)]
    return {"labels": labels, "rows": [["X" if i == k else "NV18" for k in range(n)] for i in range(n)]}


def pcie_matrix():
    labels = [f"GPU{i}" for i in range(4)]
    code = lambda i, k: "X" if i == k else ("PIX" if i // 2 == k // 2 else "SYS")
    return {"labels": labels, "rows": [[code(i, k) for k in range(4)] for i in range(4)]}


def nodes(now: int) -> list[dict]:
    running = {}
    for j in JOBS:
        if j["state"] == "running":
            for r in j["ranks"]:
                running[r["agent_id"]] = running.get(r["agent_id"], 0) + 1
    out = []
    for i, name in enumerate(SXM):
        failing = []
        verdict = "pass"
        numa = [{"node": 0, "gpus": [0, 1, 2, 3], "cpus": "0-47"}, {"node": 1, "gpus": [4, 5, 6, 7], "cpus": "48-95"}]
        if name == "sxm-e":
            verdict = "fail"
            numa = [{"node": 0, "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "cpus": "0-95"}]
            failing = [{"id": "numa.split", "status": "fail",
                        "detail": "hwloc reports one NUMA node but the GPUs' PCIe roots sit on sockets 0 and 1",
                        "remedy": "enable NUMA in the BIOS (NPS1/SNC off), then restart the agent"},
                       {"id": "gpu.clocks", "status": "warn", "detail": "GPU5 SM clock 1410 MHz < 1980 MHz expected",
                        "remedy": "nvidia-smi -q -d PERFORMANCE -i 5: check for thermal or power throttling"}]
        out.append({
            "agent_id": name, "state": "connected", "address": f"10.0.0.{5 + i}", "gpus": 8, "gpu_model": H100,
            "interconnect_class": "nvswitch", "verdict": verdict, "preflight_level": "standard",
            "preflight_at_ms": now - (i + 1) * 7 * MIN, "running_ranks": running.get(name, 0), "numa": numa,
            "matrix": nvswitch_matrix(), "failing": failing,
        })
    out.append({
        "agent_id": "pcie-1", "state": "connected", "address": "10.0.1.20", "gpus": 4, "gpu_model": "NVIDIA L40S",
        "interconnect_class": "pcie", "verdict": "warn", "preflight_level": "quick", "preflight_at_ms": now - 2 * HOUR,
        "running_ranks": 0, "numa": [{"node": 0, "gpus": [0, 1], "cpus": "0-31"}, {"node": 1, "gpus": [2, 3], "cpus": "32-63"}],
        "matrix": pcie_matrix(),
        "failing": [{"id": "p2p.bandwidth", "status": "warn", "detail": "GPU0<->GPU2 P2P 11.2 GB/s (< 20 GB/s expected)",
                     "remedy": "cross-socket traffic: place 2-GPU jobs on GPU pairs 0-1 or 2-3"}],
    })
    out.append({
        "agent_id": "nvl-1", "state": "disconnected", "address": "10.0.2.7", "gpus": 0, "gpu_model": "",
        "interconnect_class": None, "verdict": None, "preflight_level": None, "preflight_at_ms": None,
        "running_ranks": 0, "numa": [], "matrix": None, "failing": [],
    })
    return out


# ---------------------------------------------------------------------------------- series

_cache: dict[tuple[int, str], list[array]] = {}
_cache_lock = threading.Lock()


def synth(job_id: int, metric: str) -> list[array]:
    """Raw per-step values, one array per rank that reports this metric (cached)."""
    key = (job_id, metric)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        j = JOBS_BY_ID[job_id]
        cfg = j["series"]
        n = cfg.get("steps", 0) + int(cfg.get("grow_per_s", 0) * 3600)  # room to grow for an hour
        base = cfg.get("base", 200.0)
        rng = random.Random(job_id * 1000 + sum(map(ord, metric)))
        ranks = len(j["ranks"]) if metric == "step_ms" else 1
        out = []
        if n == 0 or metric not in j["metrics"]:
            _cache[key] = out
            return out
        # Shared shape of the step time: warm-up, checkpoints every 10k steps, eval every 25k.
        shared = array("d", [0.0]) * n
        for s in range(min(n, 40)):
            shared[s] = base * (4.0 - s * 0.075)
        for s in range(10_000, n, 10_000):
            shared[s] += base * 2.2  # checkpoint
        for s in range(25_000, n, 25_000):
            for d in range(6):
                if s + d < n:
                    shared[s + d] += base * 0.9  # eval
        bumps = _nonzero(shared)
        slow_rank = cfg.get("slow_rank")
        slow_node = set(cfg.get("slow_node_ranks", ()))
        rnd = rng.random
        for r in range(ranks):
            factor = 1.0
            if r in slow_node:
                factor = 1.25
            if r == slow_rank:
                factor = 1.42
            b = base * factor
            amp = base * 0.06
            if metric == "step_ms":
                vals = array("d", [b + amp * rnd() for _ in range(n)])
                for s in bumps:  # the shared shape, where it is non-zero
                    vals[s] += shared[s] * factor
                # a few spikes on single ranks
                for _ in range(2):
                    if rnd() < 0.06:
                        s = int(rnd() * n)
                        vals[s] += base * (3 + 4 * rnd())
            else:
                step_ms = [base + amp * rnd() + shared[s] for s in range(n)]
                if metric == "loss":
                    vals = array("d", [2.3 + 8.5 * math.exp(-s / (n / 6 + 1)) + 0.08 * (rnd() - 0.5) for s in range(n)])
                elif metric == "tokens_per_s":
                    tokens_per_step = j["gpus"] * 8 * 1024
                    vals = array("d", [tokens_per_step / (ms / 1000.0) for ms in step_ms])
                else:  # mfu
                    vals = array("d", [0.43 * base / ms for ms in step_ms])
            out.append(vals)
        _cache[key] = out
        return out


def _nonzero(a: array) -> list[int]:
    return [i for i, v in enumerate(a) if v]


UNITS = {"step_ms": "ms", "loss": "", "tokens_per_s": "tokens/s", "mfu": "fraction"}


def series(job_id: int, metric: str, buckets: int, frm: int | None, to: int | None) -> dict:
    j = JOBS_BY_ID[job_id]
    raw = synth(job_id, metric) if metric in j["metrics"] else []
    n = min(len(raw[0]), current_step(j, int(time.time() * 1000))) if raw else 0
    lo = max(0, frm if frm is not None else 0)
    hi = min(n - 1, to if to is not None else n - 1)
    buckets = max(1, min(buckets, 10_000))
    bucket_steps = max(1, math.ceil((hi - lo + 1) / buckets)) if hi >= lo else 1
    ranks = []
    if n and hi >= lo:
        rank_ids = [r["rank"] for r in j["ranks"]] if metric == "step_ms" else [0]
        digits = 1 if metric in ("step_ms", "tokens_per_s") else 4
        for rank, vals in zip(rank_ids, raw):
            pts = []
            for s in range(lo, hi + 1, bucket_steps):
                chunk = vals[s:min(s + bucket_steps, hi + 1)]
                pts.append([s, round(min(chunk), digits), round(max(chunk), digits), round(sum(chunk) / len(chunk), digits)])
            ranks.append({"rank": rank, "points": pts})
    return {"metric": metric, "unit": UNITS.get(metric, ""), "from": lo, "to": max(lo, hi),
            "bucket_steps": bucket_steps, "ranks": ranks}


def percentiles(vals) -> dict | None:
    if not vals:
        return None
    xs = sorted(vals)
    q = lambda p: xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]
    return {"n": len(xs), "p10": round(q(0.1), 3), "p50": round(q(0.5), 3), "p90": round(q(0.9), 3)}


def side(j: dict) -> dict:
    per_node: dict[str, int] = {}
    for r in j["ranks"]:
        per_node[r["agent_id"]] = per_node.get(r["agent_id"], 0) + 1
    step = synth(j["id"], "step_ms") if "step_ms" in j["metrics"] else []
    tps = synth(j["id"], "tokens_per_s") if "tokens_per_s" in j["metrics"] else []
    node_verdict = {n["agent_id"]: n for n in nodes(0)}
    n = current_step(j, int(time.time() * 1000))
    return {
        "job_id": j["id"], "name": j["name"], "state": j["state"], "attempt": j["attempt"],
        "nodes": [{"agent_id": a, "ranks": c,
                   "numa_layout": "0:0-7" if a == "sxm-e" else "0:0-3 1:4-7",
                   "interconnect_class": (node_verdict.get(a) or {}).get("interconnect_class"),
                   "verdict": (node_verdict.get(a) or {}).get("verdict")} for a, c in per_node.items()],
        "step_time_ms": percentiles(list(step[0][max(0, n - 2000):n])) if step else None,
        "tokens_per_s": percentiles(list(tps[0][max(0, n - 2000):n])) if tps else None,
        "diagnosis": j["diagnosis"] or {"verdict": "no diagnosis: too few steps", "healthy": True, "findings": [], "stragglers": []},
    }


def compare(a: int, b: int) -> dict:
    A, B = side(JOBS_BY_ID[a]), side(JOBS_BY_ID[b])
    env = [{"name": "NCCL_DEBUG", "a": "WARN", "b": "WARN"}]
    if {a, b} == {1, 2}:
        env = [{"name": "NCCL_SHM_DISABLE", "a": "" if a == 1 else "1", "b": "1" if b == 2 else ""},
               {"name": "NCCL_DEBUG", "a": "WARN", "b": "INFO"}]
    prov = [{"name": "torch", "a": "2.11.0", "b": "2.11.0"}, {"name": "nccl", "a": "2.27.3", "b": "2.27.3"},
            {"name": "driver", "a": "580.65.06", "b": "580.65.06" if {a, b} == {1, 2} else "570.124.06"},
            {"name": "git", "a": "3f9c2e1", "b": "3f9c2e1 (dirty)"}]
    ratio = None
    differences = []
    if A["step_time_ms"] and B["step_time_ms"]:
        ratio = round(B["step_time_ms"]["p50"] / A["step_time_ms"]["p50"], 3)
    if {a, b} == {1, 2}:
        differences = ["NCCL_SHM_DISABLE=1 on job 2 only", "job 2 ran on sxm-c, job 1 on sxm-a (both nvswitch, pass)"]
    if ratio is None:
        verdict = "no step times to compare yet"
    elif ratio >= 1.05:
        verdict = f"job {b} is {ratio:.2f}x slower: " + (differences[0] if differences else "no recorded difference explains it")
    elif ratio <= 0.95:
        verdict = f"job {b} is {1 / ratio:.2f}x faster"
    else:
        verdict = "step times match within 5%"
    return {"a": A, "b": B, "env": env, "provenance": prov, "step_time_ratio": ratio,
            "differences": differences, "verdict": verdict}


# ---------------------------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    server_version = "trainyard-mock/1"
    token: str | None = None
    delay_ms: int = 0
    verbose: bool = False

    def log_message(self, fmt, *args):  # quiet unless --verbose
        if self.verbose:
            sys.stderr.write("%s %s\n" % (self.log_date_time_string(), fmt % args))

    def send(self, status: int, body: bytes, ctype: str):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def text(self, status: int, msg: str):
        self.send(status, msg.encode(), "text/plain; charset=utf-8")

    def json(self, obj):
        self.send(200, json.dumps(obj, separators=(",", ":")).encode(), "application/json")

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urlsplit(self.path)
        path = url.path
        if path in STATIC:
            name, ctype = STATIC[path]
            return self.send(200, (WEB / name).read_bytes(), ctype)
        if PAGE.match(path):
            return self.send(200, (WEB / "index.html").read_bytes(), "text/html; charset=utf-8")
        if not path.startswith("/api/"):
            return self.text(404, f"not found: {path}")
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            return self.text(401, "unauthenticated: this controller needs a bearer token")
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        now = int(time.time() * 1000)
        try:
            return self.api(path, q, now)
        except (ValueError, KeyError) as e:
            return self.text(400, f"bad request: {e}")

    def api(self, path: str, q: dict, now: int):
        if path == "/api/jobs":
            return self.json({"now_ms": now, "jobs": [job_list_entry(j, now) for j in JOBS]})
        if path == "/api/nodes":
            return self.json({"nodes": nodes(now)})
        if path == "/api/compare":
            a, b = int(q["a"]), int(q["b"])
            for x in (a, b):
                if x not in JOBS_BY_ID:
                    return self.text(404, f"no job {x}")
            return self.json(compare(a, b))
        m = re.fullmatch(r"/api/jobs/(\d+)/telemetry", path)
        if m:
            if int(m.group(1)) not in JOBS_BY_ID:
                return self.text(404, f"no job {m.group(1)}")
            # No telemetry in the fixtures: the page says so.
            unit = {"sm_clock": "MHz", "power": "W", "temp": "°C"}.get(q.get("metric", ""))
            if unit is None:
                return self.text(400, "metric is required: sm_clock, power or temp")
            return self.json({"metric": q["metric"], "unit": unit, "node": None, "nodes": [], "x": [], "series": []})
        m = re.fullmatch(r"/api/jobs/(\d+)(/series)?", path)
        if m:
            jid = int(m.group(1))
            if jid not in JOBS_BY_ID:
                return self.text(404, f"no job {jid}")
            if not m.group(2):
                return self.json(job_detail(JOBS_BY_ID[jid], now))
            metric = q.get("metric", "step_ms")
            if metric not in UNITS:
                return self.text(400, f"unknown metric {metric!r}")
            frm = int(q["from"]) if "from" in q else None
            to = int(q["to"]) if "to" in q else None
            return self.json(series(jid, metric, int(q.get("buckets", "800")), frm, to))
        return self.text(404, f"no endpoint {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on /api (401 otherwise)")
    p.add_argument("--delay-ms", type=int, default=0, help="answer every /api request this much later")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.add_argument("--no-warm", action="store_true", help="do not synthesize the big series at start")
    args = p.parse_args()
    Handler.token = args.token
    Handler.delay_ms = args.delay_ms
    Handler.verbose = args.verbose
    if not args.no_warm:
        t0 = time.time()
        for j in JOBS:
            for metric in j["metrics"]:
                synth(j["id"], metric)
        print(f"mock: synthesized the series in {time.time() - t0:.1f} s", file=sys.stderr)
    srv = ThreadingHTTPServer((args.host, args.port), Handler)
    srv.daemon_threads = True
    print(f"mock: http://{args.host}:{args.port}/  (static files from {WEB})", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
