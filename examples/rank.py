#!/usr/bin/env python3
"""A stand-in training rank for trainyard: no GPU, no PyTorch, Python 3 standard library only.

It reads the rank environment that the agent sets (the torchrun variables plus TRAINYARD_*),
and appends receipts to TRAINYARD_RECEIPTS as JSON lines, the same schema the built-in engine
writes:

    launch   once: python version, hostname, pid, rank/world, the environment it saw, its CPU
             affinity and memory nodes (sched_getaffinity, Mems_allowed_list, memory policy) next
             to the binding the agent planned (TRAINYARD_CPUS, TRAINYARD_MEMS)
    step     per step: step, loss (a plausible decaying curve), lr, tokens, step_time_ms,
             fwd_bwd_ms and optimizer_ms (each step sleeps a compute phase, then an optimizer
             phase of the share nanochat's optimizer takes; both are timed), tokens_per_s, and
             with --mfu F an mfu: F for a step that took --step-ms, less for a slower one (the
             same work in more time), so a slowed rank's MFU drops as its step time rises
    exit     at the end: code, or signal 15 when stopped with SIGTERM (then it exits 143)

Each receipt is one `write` of a whole line followed by a flush, on a file opened in append
mode, so the agent tailing the file never sees half a receipt from us.

Stand-in timings that reproduce the field's faults (docs/diagnosis.md): the environment
variable TRAINYARD_STANDIN_SLOWDOWN=F (set on a stand-in host's agent, so its ranks inherit it)
makes every phase F times longer, as on a node whose GPUs are split over two NUMA nodes;
NCCL_SHM_DISABLE=1 makes the optimizer phase 3x longer, as NCCL falling back to sockets does;
--slow-rank R --slow-factor F makes rank R's compute phase F times longer (a straggler), from the
start or only between --slow-from-ms and --slow-until-ms (Unix times in ms: a GPU that throttles
mid-run, in step with a scripted telemetry event);
--hang-at-step K (--hang-rank R, --hang-attempt A) stops writing steps at step K until SIGTERM (a
stall, or a hang).

--checkpoint-dir DIR --checkpoint-every N writes a checkpoint every N steps (DIR/step_N/rankR.json,
written to a temporary name, fsynced and renamed, then a `checkpoint` receipt; rank 0 writes
DIR/step_N/manifest.json last, once every rank's file is there); a restarted attempt
continues after TRAINYARD_RESUME_STEP when the agent gives one. SIGUSR1, or the file named by
TRAINYARD_CHECKPOINT_REQUEST appearing or changing, asks for a checkpoint at the end of the current step (a
drain or a preemption notice); --signal-only heeds SIGUSR1 alone.

--collective joins the ranks the way torch.distributed does, over TCP: rank 0 listens on
MASTER_PORT, the others connect to MASTER_ADDR:MASTER_PORT (across hosts), and every step ends
in a barrier through rank 0, a stand-in for the optimizer's all-reduce. A peer that dies breaks
the barrier and the others exit 1 at once (as NCCL reports a closed peer); a peer cut off by the
network leaves them waiting (as a collective hangs), up to --collective-timeout seconds.

Flags for tests: --fail-at-step K exits 1 at step K (only on rank R with --fail-rank R, only in
attempt A with --fail-attempt A);
--garbage also writes a line that is not JSON, a line of invalid UTF-8 and a 10 MB line among
the valid ones (the agent must skip them).
"""

import argparse
import json
import math
import os
import platform
import random
import signal
import socket
import sys
import time

# Tokens one rank processes per step: a micro-batch of 8 sequences of 2,048 tokens.
TOKENS_PER_STEP = 8 * 2048

# Share of a step the optimizer (collectives included) takes: nanochat d26 on 8xH100 SXM
# spends 57.8 ms of a 701.9 ms step there (docs/field-notes.md §1).
OPTIMIZER_SHARE = 57.8 / 701.9

# The optimizer phase of a rank whose NCCL_SHM_DISABLE=1: the field saw the optimizer step 13.7x
# slower on an NVL node; the stand-in uses a milder 3x so tests stay short.
SHM_DISABLED_OPTIMIZER_FACTOR = 3.0

# Variables worth recording in the launch receipt when present.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
)


def device_gpu(local_rank):
    """The physical GPU index that `cuda:LOCAL_RANK` opens, as CUDA resolves it: the
    LOCAL_RANK-th entry of CUDA_VISIBLE_DEVICES when set, else LOCAL_RANK itself."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return int(entries[local_rank]) if local_rank < len(entries) else None


def mfu_fraction(text):
    """--mfu's value: a fraction above 0 and at most 1 (receipt schema v1: 0.4, not 40)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction above 0 and at most 1 (0.4, not 40)")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="number of steps (default 50)")
    p.add_argument("--step-ms", type=float, default=50.0, help="sleep per step in ms (default 50)")
    p.add_argument(
        "--mfu",
        type=mfu_fraction,
        default=None,
        metavar="F",
        help="also report mfu: F (0 to 1) at --step-ms, scaled down as a step takes longer (default: no mfu)",
    )
    p.add_argument("--fail-at-step", type=int, default=None, metavar="K", help="exit 1 at step K")
    p.add_argument(
        "--fail-rank", type=int, default=None, metavar="R", help="only rank R fails (default: every rank)"
    )
    p.add_argument(
        "--fail-attempt",
        type=int,
        default=None,
        metavar="A",
        help="fail only in attempt A (TRAINYARD_ATTEMPT; default: every attempt)",
    )
    p.add_argument("--garbage", action="store_true", help="also write invalid receipt lines")
    p.add_argument(
        "--bad-steps",
        action="store_true",
        help="also write step receipts that break schema v1 (missing, mistyped, negative, NaN fields)",
    )
    p.add_argument(
        "--hang-at-step", type=int, default=None, metavar="K", help="stop writing steps at step K (a stall)"
    )
    p.add_argument("--hang-rank", type=int, default=None, metavar="R", help="only rank R hangs")
    p.add_argument(
        "--hang-attempt", type=int, default=None, metavar="A", help="hang only in attempt A (default: every attempt)"
    )
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="where checkpoints go")
    p.add_argument(
        "--signal-only",
        action="store_true",
        help="checkpoint when asked only on SIGUSR1, never on the request file (tests of checkpoint_signal)",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps")
    p.add_argument("--collective", action="store_true", help="rendezvous over MASTER_ADDR and barrier every step")
    p.add_argument(
        "--collective-timeout", type=float, default=600.0, metavar="S", help="give up on a barrier after S s"
    )
    p.add_argument("--slow-rank", type=int, default=None, metavar="R", help="rank R computes slower")
    p.add_argument(
        "--slow-factor", type=float, default=1.3, metavar="F", help="how much slower (default 1.3)"
    )
    p.add_argument("--slow-from-ms", type=int, default=0, metavar="T", help="slow only from Unix time T ms on")
    p.add_argument("--slow-until-ms", type=int, default=0, metavar="T", help="and only until Unix time T ms")
    return p.parse_args(argv)


class Receipts:
    """Appends receipts to the rank's receipts file, one whole line per write."""

    def __init__(self, path):
        self.path = path
        self.file = open(path, "ab")

    def emit(self, kind, **fields):
        # Receipt schema v1 (docs/receipts.md): milliseconds, bytes, MFU as a fraction.
        record = {"kind": kind, "schema": 1, **fields}
        self.write_raw(json.dumps(record, separators=(",", ":")).encode() + b"\n")

    def write_raw(self, line):
        self.file.write(line)
        self.file.flush()

    def close(self):
        self.file.close()


def cpu_list(cpus):
    """{0,1,2,3,8} -> "0-3,8" (the kernel's list format)."""
    ranges, start, prev = [], None, None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            ranges.append((start, prev))
            start = prev = c
    if start is not None:
        ranges.append((start, prev))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def proc_status_field(name):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def memory_policy():
    """The task's memory policy as /proc/self/numa_maps shows it, e.g. "bind:0" or "default"."""
    try:
        with open("/proc/self/numa_maps") as f:
            fields = f.readline().split()
        return fields[1] if len(fields) > 1 else None
    except OSError:
        return None


def launch_fields(rank, local_rank, world):
    seen = {k: v for k, v in os.environ.items() if k.startswith("TRAINYARD_") or k in TORCHRUN_VARS}
    try:
        affinity = cpu_list(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "gpu": os.environ.get("TRAINYARD_GPU"),
        "cuda_device_gpu": device_gpu(local_rank),
        "cpu_affinity": affinity,
        "mems_allowed": proc_status_field("Mems_allowed_list"),
        "memory_policy": memory_policy(),
        "planned_cpus": os.environ.get("TRAINYARD_CPUS"),
        "planned_mems": os.environ.get("TRAINYARD_MEMS"),
        "argv": sys.argv,
        "env": dict(sorted(seen.items())),
    }


def loss_at(step, steps, rng):
    """A curve that looks like training: fast early descent towards a floor, a little noise."""
    scale = max(steps / 4.0, 1.0)
    return 2.5 + 8.5 * math.exp(-step / scale) + rng.gauss(0.0, 0.02)


def lr_at(step, steps, peak=0.02, warmup=5):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def write_garbage(receipts):
    receipts.write_raw(b"this line is not a receipt\n")
    receipts.write_raw(b'{"kind":"step","note":"\xff\xfe not utf-8"}\n')
    pad = "x" * (10 * 1024 * 1024)
    receipts.write_raw(json.dumps({"kind": "blob", "pad": pad}).encode() + b"\n")


def write_bad_steps(receipts, step):
    """Step receipts a careless script writes: each is stored flagged or skipped, never used."""
    receipts.emit("step", step=step, loss=1.0)  # no step_time_ms
    receipts.emit("step", step=step, step_time_ms="fast")  # wrong type
    receipts.emit("step", step=step, step_time_ms=-5.0)  # negative time
    # json.dumps writes NaN, which is not JSON: the whole line is skipped by the agent.
    receipts.write_raw(json.dumps({"kind": "step", "step": step, "step_time_ms": float("nan")}).encode() + b"\n")


class Collective:
    """A TCP star through rank 0: the rendezvous, then one barrier per step."""

    def __init__(self, rank, world, timeout):
        self.rank, self.world, self.peers, self.conn = rank, world, [], None
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = env_int("MASTER_PORT", 29500)
        if rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("0.0.0.0", port))
            server.listen(world)
            server.settimeout(timeout)
            while len(self.peers) < world - 1:
                conn, _ = server.accept()
                conn.settimeout(timeout)
                self.peers.append(conn)
            server.close()
        elif world > 1:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self.conn = socket.create_connection((addr, port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            self.conn.settimeout(timeout)
        self.master = f"{addr}:{port}"

    def barrier(self, step, flag=False):
        """Every rank reaches `step`; returns whether any rank raised `flag` (so all ranks act
        on a checkpoint request at the same step, as an all-reduce of max would); raises
        ConnectionError when a peer is gone."""
        token = step.to_bytes(8, "big")
        if self.rank == 0:
            any_flag = flag
            for conn in self.peers:
                got = recv_exact(conn, 9)
                if got[:8] != token:
                    raise ConnectionError(f"a peer is at step {int.from_bytes(got[:8], 'big')}, not {step}")
                any_flag = any_flag or got[8] == 1
            for conn in self.peers:
                conn.sendall(b"c" if any_flag else b"k")
            return any_flag
        if self.conn is not None:
            self.conn.sendall(token + (b"\x01" if flag else b"\x00"))
            answer = recv_exact(self.conn, 1)
            if answer not in (b"k", b"c"):
                raise ConnectionError("rank 0 broke the barrier")
            return answer == b"c"
        return flag


def recv_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a peer closed its connection")
        data += chunk
    return data


def write_checkpoint(directory, rank, step):
    """DIR/step_N/rankR.json, complete or absent: temporary name, fsync, rename, fsync the dir."""
    step_dir = os.path.join(directory, f"step_{step}")
    os.makedirs(step_dir, exist_ok=True)
    final = os.path.join(step_dir, f"rank{rank}.json")
    tmp = final + ".tmp"
    data = json.dumps({"step": step, "rank": rank}).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    fsync_dir(step_dir)
    return step_dir, len(data)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir, world, wait_s=10.0):
    """Rank 0, once every rank's file of the step is there: DIR/step_N/manifest.json, written
    last (temporary name, fsync, rename), which is what makes the checkpoint complete for a
    restart that finds it on disk before its receipts arrived. Gives up after `wait_s`."""
    files = [f"rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while not all(os.path.exists(os.path.join(step_dir, f)) for f in files):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    final = os.path.join(step_dir, "manifest.json")
    tmp = final + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    fsync_dir(step_dir)
    return True


def requested(request, stop):
    """Whether the agent (re)wrote the checkpoint request since the last one answered."""
    if request is None:
        return False
    try:
        changed = os.stat(request).st_mtime_ns
    except OSError:
        return False
    if changed <= stop.get("answered_ns", 0):
        return False
    stop["answered_ns"] = changed
    return True


def resume_step():
    """The step to continue after, when this attempt resumes from a checkpoint; else None."""
    if os.environ.get("TRAINYARD_RESUME") != "1":
        return None
    try:
        return int(os.environ.get("TRAINYARD_RESUME_STEP", ""))
    except ValueError:
        return None


def sleep_until(deadline, stop):
    """Sleeps until `deadline` (time.monotonic) in slices, so SIGTERM is honoured promptly."""
    while stop["signal"] is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.01, left))


def main(argv=None):
    args = parse_args(argv)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    path = os.environ.get("TRAINYARD_RECEIPTS")
    if not path:
        path = "receipts.jsonl"
        print(f"TRAINYARD_RECEIPTS is not set; writing receipts to {path}", file=sys.stderr)

    stop = {"signal": None}

    def on_sigterm(signum, _frame):
        stop["signal"] = signum

    def on_sigusr1(_signum, _frame):
        stop["checkpoint"] = True

    stop["checkpoint"] = False
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGUSR1, on_sigusr1)
    request = os.environ.get("TRAINYARD_CHECKPOINT_REQUEST")

    receipts = Receipts(path)
    collective = None
    if args.collective:
        try:
            collective = Collective(rank, world, args.collective_timeout)
        except OSError as e:
            receipts.emit("exit", code=1, reason=f"rendezvous failed: {e}")
            print(f"rank {rank}: rendezvous failed: {e}", file=sys.stderr)
            return 1
    fields = launch_fields(rank, local_rank, world)
    resumed = resume_step()
    first_step = 0 if resumed is None else resumed + 1
    fields["resumed_from"] = resumed
    fields["at_ms"] = int(time.time() * 1000)
    if collective is not None:
        fields["rendezvous"] = {"master": collective.master, "world_size": world}
    receipts.emit("launch", **fields)
    rng = random.Random(rank)
    slowdown = float(os.environ.get("TRAINYARD_STANDIN_SLOWDOWN", "1") or "1")
    compute_s = args.step_ms / 1000.0 * (1.0 - OPTIMIZER_SHARE) * slowdown
    optimizer_s = args.step_ms / 1000.0 * OPTIMIZER_SHARE * slowdown
    if os.environ.get("NCCL_SHM_DISABLE", "0").strip() not in ("", "0"):
        optimizer_s *= SHM_DISABLED_OPTIMIZER_FACTOR
    for step in range(first_step, args.steps):
        attempt = env_int("TRAINYARD_ATTEMPT", 0)
        failing = (args.fail_rank is None or args.fail_rank == rank) and (
            args.fail_attempt is None or args.fail_attempt == attempt
        )
        if failing and args.fail_at_step is not None and step == args.fail_at_step:
            receipts.emit("exit", code=1, step=step, reason="--fail-at-step")
            print(f"rank {rank}: failing at step {step} as asked", file=sys.stderr)
            return 1
        if step == args.hang_at_step and args.hang_rank in (None, rank) and args.hang_attempt in (None, attempt):
            print(f"rank {rank}: hanging at step {step} as asked", file=sys.stderr)
            sleep_until(math.inf, stop)
        started = time.monotonic()
        now_ms = time.time() * 1000
        slow = args.slow_rank == rank and now_ms >= args.slow_from_ms and (
            args.slow_until_ms == 0 or now_ms < args.slow_until_ms
        )
        sleep_until(started + compute_s * (args.slow_factor if slow else 1.0), stop)
        computed = time.monotonic()
        sleep_until(computed + optimizer_s, stop)
        if stop["signal"] is not None:
            break  # a step cut short is not a step
        asked = stop["checkpoint"] or (not args.signal_only and requested(request, stop))
        if collective is not None:
            try:
                asked = collective.barrier(step, asked)
            except (OSError, ConnectionError) as e:
                receipts.emit("exit", code=1, step=step, reason=f"collective failed: {e}")
                print(f"rank {rank}: collective failed at step {step}: {e}", file=sys.stderr)
                return 1
        finished = time.monotonic()
        elapsed = max(finished - started, 1e-6)
        metrics = {}
        if args.mfu is not None:
            # The same work in more time: a step slower than --step-ms uses less of the GPU.
            metrics["mfu"] = round(min(args.mfu * (args.step_ms / 1000.0) / elapsed, 1.0), 4)
        receipts.emit(
            "step",
            step=step,
            loss=round(loss_at(step, args.steps, rng), 5),
            lr=round(lr_at(step, args.steps), 7),
            tokens=TOKENS_PER_STEP,
            step_time_ms=round(elapsed * 1000.0, 3),
            fwd_bwd_ms=round((computed - started) * 1000.0, 3),
            optimizer_ms=round((finished - computed) * 1000.0, 3),
            tokens_per_s=round(TOKENS_PER_STEP * world / elapsed, 1),
            **metrics,
            at_ms=int(time.time() * 1000),
        )
        due = args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0
        if args.checkpoint_dir and (due or asked):
            began = time.monotonic()
            try:
                path, size = write_checkpoint(args.checkpoint_dir, rank, step)
                if rank == 0:
                    # Periodic checkpoints are taken by every rank at the same step; one asked
                    # for may be taken at different steps, so rank 0 waits only briefly then.
                    write_manifest(path, world, 10.0 if due else 0.5)
            except OSError as e:
                receipts.emit("exit", code=1, step=step, reason=f"checkpoint failed: {e}")
                print(f"rank {rank}: checkpoint at step {step} failed: {e}", file=sys.stderr)
                return 1
            took = (time.monotonic() - began) * 1000.0
            receipts.emit("checkpoint", step=step, bytes=size, duration_ms=round(took, 3), path=path)
            stop["checkpoint"] = False
            if asked:
                # Asked because this host is going away: take no step that would be lost, and
                # wait to be stopped (trainyard moves the job once every rank checkpointed).
                print(f"rank {rank}: checkpointed at step {step} as asked; waiting to be moved", file=sys.stderr)
                sleep_until(math.inf, stop)
                break
        if args.garbage and step == 1:
            write_garbage(receipts)
        if args.bad_steps and step == 10:
            write_bad_steps(receipts, step)
    if stop["signal"] is not None:
        signum = stop["signal"]
        receipts.emit("exit", signal=signum, code=128 + signum, reason="terminated")
        receipts.close()
        return 128 + signum
    receipts.emit("exit", code=0, steps=args.steps, reason="completed")
    receipts.close()
    print(f"rank {rank}/{world}: {args.steps} steps done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
