"""What the bootstrap costs a training loop on a CPU: the hook path alone, and a real loop.

    .venv/bin/python python/bench_hooks.py [--runs 5] [--steps 100000] [--out docs/results]

Two measures, each in fresh interpreters alternating without the bootstrap
(TRAINYARD_RECEIPTS_AUTO=0: the same sitecustomize on the path, doing nothing) and with it:

- **the hook path**: `--steps` optimizer steps of an SGD over one parameter with no gradient (the
  cheapest step torch has), timed around the loop; the difference of the medians over the steps
  is what the hooks, the queue and the worker thread (which shares the interpreter) cost a step.
  The issue's bound is 2 us a step.
- **a real loop at about 50 ms a step**: a small MLP trained on CPU with a forward, backward and
  AdamW step of about 50 ms, 60 steps a run after 5 of warm-up, timed by the script; the ratio of
  the medians is the overhead (bound: 0.5 %). Separate processes of the same loop differ by
  several percent here, more than the bound, so the same loop also runs in one process with the
  bootstrap, alternating blocks of 8 steps with its optimizer hooks in place and taken out
  (8 blocks each, `--runs` times): the median ratio of those pairs is the finer measure.

Writes one JSON line to OUT/bench_hooks-<UTC date and time>.jsonl: the bench, its arguments,
the commit (and whether the tree was dirty), the machine's facts and every run's figures.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOOK_PATH = """
import sys, time, torch
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.1)
n = int(sys.argv[1])
for _ in range(1000):
    opt.step()
t = time.perf_counter()
for _ in range(n):
    opt.step()
print((time.perf_counter() - t) / n * 1e6)
"""

# With the bootstrap on, the same process also alternates blocks of steps with the bootstrap's
# optimizer hooks in place and taken out, which removes the spread between processes (several
# percent here): the paired ratio is the finer measure of the same cost.
PAIRED_LOOP = """
import sys, time, statistics, torch
import torch.optim.optimizer as o
torch.manual_seed(0)
torch.set_num_threads(1)
width, blocks, per_block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(256, width)
hooks = (dict(o._global_optimizer_pre_hooks), dict(o._global_optimizer_post_hooks))
def step():
    t = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t
for _ in range(5):
    step()
on, off = [], []
for b in range(2 * blocks):
    hooked = b % 2 == 0
    o._global_optimizer_pre_hooks.clear(); o._global_optimizer_post_hooks.clear()
    if hooked:
        o._global_optimizer_pre_hooks.update(hooks[0]); o._global_optimizer_post_hooks.update(hooks[1])
    (on if hooked else off).append(statistics.median(step() for _ in range(per_block)))
print(statistics.median(on) / statistics.median(off))
"""

REAL_LOOP = """
import sys, time, statistics, torch
torch.manual_seed(0)
torch.set_num_threads(1)
width = int(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(256, width)
times = []
for step in range(int(sys.argv[1]) + 5):
    t = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t)
print(statistics.median(times[5:]) * 1e3)
"""


def boot_dir(tmp: Path) -> Path:
    """A bootstrap directory laid out as the agent lays it out."""
    boot = tmp / "boot"
    boot.mkdir()
    shutil.copy(ROOT / "python" / "bootstrap" / "sitecustomize.py", boot)
    shutil.copytree(ROOT / "python" / "trainyard_receipts", boot / "trainyard_receipts",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return boot


def run(code: str, args, boot: Path, on: bool, tmp: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(PYTHONPATH=str(boot), TRAINYARD_RECEIPTS=str(tmp / "receipts.jsonl"), RANK="0",
               TRAINYARD_RECEIPTS_AUTO="1" if on else "0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def alternate(name, code, args, runs, boot, tmp):
    figures = {"off": [], "on": []}
    for i in range(runs):
        for mode in ("off", "on"):
            figures[mode].append(run(code, args, boot, mode == "on", tmp))
            print(f"{name} run {i + 1} {mode}: {figures[mode][-1]:.3f}", flush=True)
    return figures


def facts():
    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    mem = next((l.split(":", 1)[1].strip() for l in open("/proc/meminfo") if l.startswith("MemTotal")), "")
    return {"cores": os.cpu_count(), "cpu": cpu, "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(),
            "commit": sh("git", "-C", str(ROOT), "rev-parse", "HEAD"),
            "dirty": bool(sh("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--loop-steps", type=int, default=60)
    p.add_argument("--width", type=int, default=1152, help="the MLP's width (about 50 ms a step on one core here)")
    p.add_argument("--out", default=str(ROOT / "docs" / "results"))
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-hooks-"))
    try:
        boot = boot_dir(tmp)
        hooks = alternate("hook path, us a step", HOOK_PATH, [a.steps], a.runs, boot, tmp)
        loop = alternate("real loop, ms a step", REAL_LOOP, [a.loop_steps, a.width], a.runs, boot, tmp)
        paired = [run(PAIRED_LOOP, [a.width, 8, 8], boot, True, tmp) for _ in range(a.runs)]
        print(f"real loop, blocks with and without the hooks in one process: {paired}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {m: statistics.median(v) for m, v in f.items()} for k, f in (("hooks", hooks), ("loop", loop))}
    result = {
        "bench": "bench_hooks",
        "args": vars(a),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": facts(),
        "hook_path_us": hooks,
        "real_loop_ms": loop,
        "hook_cost_us_per_step": med["hooks"]["on"] - med["hooks"]["off"],
        "real_loop_ratio": med["loop"]["on"] / med["loop"]["off"],
        "real_loop_paired_ratios": paired,
        "real_loop_paired_ratio": statistics.median(paired),
    }
    print(f"hook path: medians {med['hooks']['off']:.3f} us without, {med['hooks']['on']:.3f} us with: "
          f"{result['hook_cost_us_per_step']:.3f} us a step (bound 2)")
    print(f"real loop: medians {med['loop']['off']:.2f} ms without, {med['loop']['on']:.2f} ms with: "
          f"{result['real_loop_ratio']:.4f}x (bound 1.005); in one process, blocks alternating: "
          f"{result['real_loop_paired_ratio']:.4f}x")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    path = out / f"bench_hooks-{stamp}.jsonl"
    path.write_text(json.dumps(result) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
