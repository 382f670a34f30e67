"""The built-in engine against PyTorch on one GPU: the same model, weights and batches, in
alternating runs. Prints a table and writes summary.json (and every run's receipts or output)
into RESULTS_DIR.

    python3 deploy/gpu/engine_bench.py --bin target/release RESULTS_DIR [--rounds 3] [--steps 30]

Each run's figure is the median step time over steps 4..STEPS (the first three are CUDA and
cuBLAS autotuning, allocator growth and, for torch.compile, compilation); each system's figure
is the best of its runs, and the runs alternate (engine, compile, engine, compile, ...) so that
a drifting GPU clock or a noisy neighbour hits both alike. Also, once each: PyTorch eager; the
engine with its loss unfused (what the fused loss buys); the engine with nanochat's SSSL
attention windows; d20 against eager. Start-up is process start to the end of step 1, read
from the step receipt's time, for engine runs after the first (kernels in the driver's on-disk
cache).

Needs: a python with torch (this one) and the engine binary. check.sh sets up the libraries.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST = 3  # steps left out of each median (steps 4..N count)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_engine(a, res, tag, depth, batch, shards, init, extra, export=False):
    receipts = res / f"engine-{tag}.jsonl"
    receipts.unlink(missing_ok=True)
    args = [str(a.bin / "trainyard-engine"), "train", "--device", "cuda", "--preset", f"d{depth}",
            "--vocab-size", "50257", "--train", str(shards), "--seq-len", "2048",
            "--device-batch-size", str(batch), "--total-batch-size", str(batch * 2048),
            "--num-iterations", str(a.steps), "--warmup-steps", "5", *a.lr, *extra]
    if init is not None:
        args += ["--export-init", str(init)] if export else ["--init-weights", str(init)]
    env = dict(os.environ, TRAINYARD_RECEIPTS=str(receipts))
    log(f"engine {tag}: {' '.join(extra) or 'default'}")
    t0 = time.time()
    with open(res / f"engine-{tag}.log", "w") as out:
        rc = subprocess.run(args, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    if rc != 0 or not receipts.exists():
        log(f"engine {tag} failed (exit {rc}): see engine-{tag}.log")
        return None
    rows = [json.loads(line) for line in receipts.read_text().splitlines() if line.strip()]
    launch = next(r for r in rows if r["kind"] == "launch")
    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return None
    if len(steps) <= FIRST:
        return {"startup_to_step1_s": steps[0]["time"] - t0, "startup_to_launch_s": launch["time"] - t0}
    ms = [s["step_time_ms"] for s in steps]
    return {
        "step_ms": statistics.median(ms[FIRST:]),
        "losses": [s["loss"] for s in steps],
        "startup_to_step1_s": steps[0]["time"] - t0,
        "startup_to_launch_s": launch["time"] - t0,
        "peak_allocated_bytes": max(s.get("mem_peak_allocated_bytes") or 0 for s in steps),
        "peak_reserved_bytes": max(s.get("mem_peak_reserved_bytes") or 0 for s in steps),
        "flops_per_token": launch["flops_per_token"],
        "peak_flops": steps[-1].get("mfu_peak_flops"),
        "device": launch["device"],
        "loss_kernel": launch.get("loss_kernel"),
        "block_kernels": launch.get("block_kernels"),
        "fwd_bwd_ms": statistics.median(s["fwd_bwd_ms"] for s in steps[FIRST:]),
        "optimizer_ms": statistics.median(s.get("optimizer_ms", float("nan")) for s in steps[FIRST:]),
    }


def run_reference(a, res, tag, depth, batch, shards, init, compile_):
    mode = "compile" if compile_ else "eager"
    out = res / f"reference-{tag}.json"
    args = [sys.executable, str(ROOT / "engine/reference/gpt_ref.py"), "--device", "cuda",
            "--weights", str(init), "--depth", str(depth), "--train", str(shards), "--seq-len", "2048",
            "--device-batch-size", str(batch), "--total-batch-size", str(batch * 2048),
            "--num-iterations", str(a.steps), "--warmup-steps", "5", *a.lr]
    if compile_:
        args.append("--compile")
    log(f"reference {tag} ({mode})")
    with open(out, "w") as o, open(res / f"reference-{tag}.log", "w") as e:
        rc = subprocess.run(args, stdout=o, stderr=e, timeout=a.timeout).returncode
    try:
        r = json.loads(out.read_text().strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        log(f"reference {tag} failed (exit {rc}): see reference-{tag}.log")
        return None
    return {
        "step_ms": statistics.median(r["step_ms"][FIRST:]),
        "losses": r["losses"],
        "peak_allocated_bytes": r.get("peak_allocated_bytes"),
        "peak_reserved_bytes": r.get("peak_reserved_bytes"),
    }


def best(runs):
    runs = [r for r in runs if r]
    return min(runs, key=lambda r: r["step_ms"]) if runs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--bin", type=Path, default=ROOT / "target/release")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--work", type=Path, help="where shards and initial weights go (default: a new temporary directory)")
    ap.add_argument("--skip", default="", help="comma- or space-separated: eager unfused blocks sssl d20 startup")
    ap.add_argument("--lr-scale", type=float, default=None,
                    help="LR multiplier of every run (default: nanochat's sqrt(batch / 2^19), whose "
                         "first steps are stable enough to compare losses; 1 diverges chaotically)")
    a = ap.parse_args()
    a.lr = ["--lr-scale", str(a.lr_scale)] if a.lr_scale is not None else []
    a.bin = a.bin.resolve()
    res = a.results.resolve()
    res.mkdir(parents=True, exist_ok=True)
    skip = set(a.skip.replace(",", " ").split())
    work = a.work.resolve() if a.work else Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(a.bin / "trainyard-engine"), "tokenize", "--out", str(work / "shards"),
                    *map(str, sorted((ROOT / "engine/corpus").glob("*.txt")))], check=True,
                   stdout=subprocess.DEVNULL)
    shards = work / "shards/train_000000.bin"
    init = work / "init-d12.safetensors"
    eng, comp = [], []
    for r in range(1, a.rounds + 1):
        eng.append(run_engine(a, res, f"d12-r{r}", 12, 16, shards, init, [], export=(r == 1)))
        if not init.exists():
            sys.exit("the first engine run wrote no initial weights: see engine-d12-r1.log")
        comp.append(run_reference(a, res, f"d12-compile-r{r}", 12, 16, shards, init, True))
    once = {}
    if "eager" not in skip:
        once["eager"] = run_reference(a, res, "d12-eager", 12, 16, shards, init, False)
    if "unfused" not in skip:
        once["engine_unfused_loss"] = run_engine(a, res, "d12-unfused", 12, 16, shards, init, ["--unfused-loss"])
    if "blocks" not in skip:
        once["engine_unfused_blocks"] = run_engine(a, res, "d12-unfused-blocks", 12, 16, shards, init, ["--unfused-blocks"])
    if "sssl" not in skip:
        once["engine_sssl"] = run_engine(a, res, "d12-sssl", 12, 16, shards, init, ["--window-pattern", "SSSL"])
    if "startup" not in skip:
        # A plain start (no weights file to read), twice: the second with every cache warm.
        for r in (1, 2):
            steps, a.steps = a.steps, 1
            once[f"startup_run{r}"] = run_engine(a, res, f"d12-startup{r}", 12, 16, shards, None, [])
            a.steps = steps
    d20 = {}
    if "d20" not in skip:
        init20 = work / "init-d20.safetensors"
        d20["engine"] = run_engine(a, res, "d20", 20, 8, shards, init20, [], export=True)
        if init20.exists():
            d20["eager"] = run_reference(a, res, "d20-eager", 20, 8, shards, init20, False)
    summarize(res, eng, comp, once, d20)


def summarize(res, eng, comp, once, d20):
    e, c = best(eng), best(comp)
    out = {"engine_runs_ms": [r and r["step_ms"] for r in eng], "compile_runs_ms": [r and r["step_ms"] for r in comp]}
    tokens = 16 * 2048

    def row(name, r, fpt, peak, tok=tokens):
        if not r:
            print(f"{name:<26} failed")
            return
        tps = tok / (r["step_ms"] / 1e3)
        mfu = 100 * fpt * tps / peak if fpt and peak else float("nan")
        r.update({"tokens_per_s": tps, "mfu_pct": mfu})
        print(f"{name:<26}{r['step_ms']:>9.1f}{tps:>10.0f}{mfu:>7.1f}"
              f"{(r.get('peak_allocated_bytes') or 0) / 2**30:>16.1f}{(r.get('peak_reserved_bytes') or 0) / 2**30:>15.1f}")

    print(f"{'run (best of runs)':<26}{'step ms':>9}{'tok/s':>10}{'MFU %':>7}{'peak alloc GiB':>16}{'peak resv GiB':>15}")
    fpt = e["flops_per_token"] if e else None
    peak = e["peak_flops"] if e else None
    row("d12 engine", e, fpt, peak)
    row("d12 torch.compile", c, fpt, peak)
    for k, r in once.items():
        if k.startswith("startup"):
            continue
        f = r["flops_per_token"] if r and "flops_per_token" in r else fpt
        row(f"d12 {k}", r, f, peak)
    if d20.get("engine"):
        f20 = d20["engine"]["flops_per_token"]
        row("d20 engine", d20["engine"], f20, peak, 8 * 2048)
        row("d20 eager", d20.get("eager"), f20, peak, 8 * 2048)
    if e and c:
        out["ratio_vs_compile"] = c["step_ms"] / e["step_ms"]
        n = min(20, len(e["losses"]), len(c["losses"]))
        out["loss_max_rel_diff_first20_vs_compile"] = max(abs(x - y) / abs(y) for x, y in zip(e["losses"][:n], c["losses"][:n]))
        print(f"  tokens/s ratio engine / compile: {out['ratio_vs_compile']:.3f}  (runs: engine {out['engine_runs_ms']}, compile {out['compile_runs_ms']})")
        print(f"  losses, first {n} steps, max relative difference vs compile: {out['loss_max_rel_diff_first20_vs_compile']:.3g}")
        print(f"  peak allocated: engine {e['peak_allocated_bytes'] / 2**30:.1f} GiB, compile {(c['peak_allocated_bytes'] or 0) / 2**30:.1f} GiB")
        print(f"  loss kernel: {e['loss_kernel']}; fwd+bwd {e['fwd_bwd_ms']:.1f} ms, optimizer {e['optimizer_ms']:.1f} ms")
        print(f"  block kernels: {e.get('block_kernels')}")
    for k, r in once.items():
        if k.startswith("startup") and r:
            print(f"  start-up ({k}, no weights file): process start to launch receipt {r['startup_to_launch_s']:.2f} s, "
                  f"to the end of step 1 {r['startup_to_step1_s']:.2f} s")
    if once.get("eager") and e:
        out["ratio_vs_eager"] = once["eager"]["step_ms"] / e["step_ms"]
        n = min(20, len(e["losses"]), len(once["eager"]["losses"]))
        out["loss_max_rel_diff_first20_vs_eager"] = max(
            abs(x - y) / abs(y) for x, y in zip(e["losses"][:n], once["eager"]["losses"][:n]))
        print(f"  losses, first {n} steps, max relative difference vs eager: {out['loss_max_rel_diff_first20_vs_eager']:.3g}")
        print(f"  tokens/s ratio engine / eager: {out['ratio_vs_eager']:.3f}")
    if d20.get("engine") and d20.get("eager"):
        out["d20_ratio_vs_eager"] = d20["eager"]["step_ms"] / d20["engine"]["step_ms"]
        print(f"  d20 tokens/s ratio engine / eager: {out['d20_ratio_vs_eager']:.3f}")
    out.update({"engine": e, "compile": c, "once": once, "d20": d20})
    (res / "summary.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
