"""`start()`, `Receipts` and `StepTimer`: the API a training script calls."""

from __future__ import annotations

import atexit
import contextlib
import math
import operator
import os
import platform
import socket
import sys
import threading
import time
from types import ModuleType, TracebackType
from typing import Any, Dict, Iterator, Optional, Tuple, Type

from . import _cuda, _provenance
from ._encode import encode
from ._version import __version__
from ._writer import Writer, warn
from .peaks import dense_bf16_peak

SCHEMA_VERSION = 1
"""The receipt schema version written (docs/receipts.md)."""

DEFAULT_CAPACITY = 10_000
"""Receipts the queue holds before it drops new ones (a few MB at most)."""

DEFAULT_CLOSE_TIMEOUT_S = 5.0
"""How long `close()` (and the exit of the interpreter) waits for queued receipts."""

EXIT_STATUSES = ("ok", "failed")

_warned_disabled = False

AUTO_THREAD = "trainyard-auto"
"""The thread of the bootstrap's worker (`_auto`)."""

_started_pid: Optional[int] = None
_opening_for_bootstrap = False  # set by the bootstrap around its own call of `start()`


def started_in_process() -> bool:
    """Whether the script itself called `start()` in this process (a forked child inherits
    the module's state, not the call). The bootstrap then writes no receipt of its own."""
    return _started_pid == os.getpid()


class Receipts:
    """A rank's receipts: `step`, `eval`, `checkpoint`, `exit` (and `emit` for other kinds).

    Made by `start()`, which has written the launch receipt. Every method only queues its
    receipt and returns at once (True if queued, False if dropped or disabled); a daemon thread
    appends the lines to the receipts file. When the queue is full (the file system is stuck)
    receipts are dropped and counted: the next receipt that gets through carries
    `dropped_receipts` (how many since the previous one) and the exit receipt
    `dropped_receipts_total`. Values that JSON cannot hold (NaN, infinities) and negative times
    or sizes are written as null, their names in the receipt's `nulled_fields`, and counted in
    the exit receipt's `nulled_values`.

    Used as a context manager, it writes an exit receipt when the block ends unless one was
    written (`failed` with the exception as the reason if the block raised), then closes.
    Methods may be called from several threads.

    Attributes:
        path: the receipts file (None: disabled).
        world_size, tokens_per_step, model_flops_per_token, peak_flops: as given to `start()`
            (peak_flops as found in the table when not given).
        last_step: the step of the newest step receipt.
        dropped: receipts dropped so far because the queue was full.
        nulled: values written as null so far (NaN, infinities, negative times or sizes).
    """

    def __init__(
        self,
        path: Optional[str],
        *,
        world_size: int = 1,
        tokens_per_step: Optional[int] = None,
        model_flops_per_token: Optional[float] = None,
        peak_flops: Optional[float] = None,
        cuda_device: Optional[int] = None,
        torch: Optional[ModuleType] = None,
        capacity: int = DEFAULT_CAPACITY,
        _close_at_exit: bool = True,
    ) -> None:
        """Prefer `start()`. `path` None disables writing; see `start()` for the others.
        `_close_at_exit=False` is the bootstrap's: it closes its receipts itself at exit, after
        its last step and exit receipts, and an exit handler of their own would run first."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, not {world_size}")
        if tokens_per_step is not None and tokens_per_step < 0:
            raise ValueError(f"tokens_per_step must not be negative, not {tokens_per_step}")
        self.path = path
        self.world_size = world_size
        self.tokens_per_step = tokens_per_step
        self.model_flops_per_token = model_flops_per_token
        self.peak_flops = peak_flops
        self.last_step: Optional[int] = None
        self.dropped = 0
        self.nulled = 0
        self._unreported_drops = 0
        self._exited = False
        self._cuda_device = cuda_device
        self._torch = torch
        self._lock = threading.Lock()
        self._warned_mfu = False
        self._writer = Writer(path, capacity) if path is not None else None
        # The checkpoint request trainyard writes on a drain or a preemption notice, and the
        # modification time of the last one answered.
        self._request = os.environ.get("TRAINYARD_CHECKPOINT_REQUEST") or None
        self._answered_ns = 0
        if self._writer is not None and _close_at_exit:
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        """Whether receipts are written: False outside trainyard without a path, and after
        `close()`."""
        return self._writer is not None

    def emit(self, kind: str, **fields: Any) -> bool:
        """Queues a receipt of any kind (`goodput`, or a kind of your own) with `fields`."""
        return self._emit(kind, fields, force=False)

    def _emit(self, kind: str, fields: Dict[str, Any], *, force: bool) -> bool:
        """Queues a receipt; `force` queues it even when the queue is full (launch, exit)."""
        record: Dict[str, Any] = {
            "kind": kind,
            "schema": SCHEMA_VERSION,
            "created_at_ms": int(time.time() * 1000),
        }
        record.update(fields)
        record.update(kind=kind, schema=SCHEMA_VERSION)  # no field may replace these two
        with self._lock:
            writer = self._writer
            if writer is None:
                return False
            if self._unreported_drops:
                record["dropped_receipts"] = self._unreported_drops
            line, nulled = encode(record)
            if not writer.put(line, force=force):
                self.dropped += 1
                self._unreported_drops += 1
                return False
            self._unreported_drops = 0
            self.nulled += len(nulled)
        return True

    def step(
        self,
        step: int,
        *,
        step_time_ms: float,
        loss: Optional[float] = None,
        tokens: Optional[int] = None,
        **fields: Any,
    ) -> bool:
        """Queues the step receipt of optimizer step `step` (an integer from 0).

        step_time_ms: wall time of the whole step in milliseconds (`step_timer` measures it).
        loss: the training loss; a float, or a one-element tensor (converting a CUDA tensor
            waits for the GPU, as `.item()` does).
        tokens: tokens THIS RANK processed in the step, when it differs from `tokens_per_step`.
        fields: any other field, e.g. `lr`, `grad_norm`, and the timing fields of schema v1:
            `fwd_bwd_ms`, `optimizer_ms`, `optimizer_reduce_ms`,
            `optimizer_compute_gather_ms`, `optimizer_wait_ms` (milliseconds).

        Written for you: `tokens` (of the whole job: this rank's tokens x world_size),
        `tokens_per_s` (those over the step time), `mfu` (this rank's model FLOP/s over its
        GPU's dense bf16 peak, a fraction; absent when the peak or `model_flops_per_token` is
        unknown) and, when CUDA is initialised, `mem_allocated_bytes`, `mem_reserved_bytes`
        and `mem_peak_allocated_bytes` (peak since the start or the script's last
        `torch.cuda.reset_peak_memory_stats`). A field you pass wins over a computed one.
        """
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be an integer from 0, not {step}")
        if self._writer is None:
            return False
        self.last_step = step
        step_time_ms = float(step_time_ms)
        record: Dict[str, Any] = {"step": step, "step_time_ms": step_time_ms}
        if loss is not None:
            record["loss"] = float(loss)
        rank_tokens = tokens if tokens is not None else self.tokens_per_step
        if rank_tokens is not None:
            record.update(self._throughput(rank_tokens, step_time_ms))
        record.update(_cuda.memory(self._torch, self._cuda_device))
        record.update(fields)
        return self._emit("step", record, force=False)

    def _throughput(self, rank_tokens: int, step_time_ms: float) -> Dict[str, Any]:
        """`tokens`, `tokens_per_s` and `mfu` of a step in which this rank processed
        `rank_tokens` tokens in `step_time_ms`."""
        job_tokens = rank_tokens * self.world_size
        out: Dict[str, Any] = {"tokens": job_tokens}
        seconds = step_time_ms / 1000.0
        if not (math.isfinite(seconds) and seconds > 0):
            return out
        out["tokens_per_s"] = job_tokens / seconds
        if self.model_flops_per_token and self.peak_flops:
            mfu = self.model_flops_per_token * rank_tokens / seconds / self.peak_flops
            if mfu <= 1.0:
                out["mfu"] = mfu
            else:
                # Above the peak: model_flops_per_token or the peak is wrong. Kept out of `mfu`,
                # where schema v1 would flag the receipt, and kept visible here.
                out["mfu_above_peak"] = mfu
                if not self._warned_mfu:
                    self._warned_mfu = True
                    warn(
                        f"MFU {mfu:.3g} is above 1: model_flops_per_token"
                        f" ({self.model_flops_per_token:g}) or the peak"
                        f" ({self.peak_flops:g} FLOP/s) is too high; mfu is not written"
                    )
        return out

    def step_timer(self, step: int, *, synchronize: bool = False) -> StepTimer:
        """A context manager that times step `step` and queues its step receipt when the block
        ends normally (no receipt if it raises: a step cut short is not a step)::

            with receipts.step_timer(step) as s:
                with s.phase("fwd_bwd"):
                    loss = model(batch).loss
                    loss.backward()
                with s.phase("optimizer"):
                    opt.step()
                s.loss = loss.item()

        synchronize: wait for the GPU (`torch.cuda.synchronize`) before each clock read, so
            the times cover the kernels the host queued. Leave it off when the step already
            waits (e.g. `loss.item()` at its end, as above): CUDA runs asynchronously and a
            host clock alone measures only the queueing.
        """
        return StepTimer(self, step, synchronize)

    def eval(
        self,
        step: int,
        *,
        val_loss: Optional[float] = None,
        duration_ms: Optional[float] = None,
        **fields: Any,
    ) -> bool:
        """Queues an eval receipt: `step`, `val_loss`, `duration_ms` (how long the evaluation
        took: trainyard counts it as eval time in the job's goodput), any other metric."""
        record: Dict[str, Any] = {"step": operator.index(step)}
        if val_loss is not None:
            record["val_loss"] = float(val_loss)
        if duration_ms is not None:
            record["duration_ms"] = float(duration_ms)
        record.update(fields)
        return self._emit("eval", record, force=False)

    def should_checkpoint(self) -> bool:
        """True once per request to checkpoint now: trainyard asks on a drain (`ctl drain`) or a
        preemption notice, and moves the job once every rank has written a checkpoint receipt.
        Call it at the end of each step, checkpoint when it says so, and record it with
        `checkpoint()`. Every rank should agree: in a multi-rank job, reduce the answer (e.g. an
        all-reduce of max) before acting, so all ranks checkpoint at the same step."""
        if self._request is None:
            return False
        try:
            changed = os.stat(self._request).st_mtime_ns
        except OSError:
            return False
        if changed <= self._answered_ns:
            return False
        self._answered_ns = changed
        return True

    @staticmethod
    def resume_point() -> Optional[Tuple[int, str]]:
        """(step, path) of the newest checkpoint every rank of an earlier attempt wrote and whose
        path exists on this host, when this attempt resumes (`[restart] resume`); else None."""
        if os.environ.get("TRAINYARD_RESUME") != "1":
            return None
        try:
            step = int(os.environ.get("TRAINYARD_RESUME_STEP", ""))
        except ValueError:
            return None
        return step, os.environ.get("TRAINYARD_RESUME_PATH", "")

    def checkpoint(
        self,
        step: int,
        path: str | os.PathLike[str],
        *,
        size_bytes: Optional[int] = None,
        duration_ms: Optional[float] = None,
        **fields: Any,
    ) -> bool:
        """Queues a checkpoint receipt: `step`, `path`, `bytes` (size_bytes) and `duration_ms`
        (how long saving took: trainyard counts it as checkpoint time in the job's goodput)."""
        record: Dict[str, Any] = {
            "step": operator.index(step),
            "path": os.fspath(path),
            "bytes": size_bytes,
            "duration_ms": duration_ms,
            **fields,
        }
        return self._emit("checkpoint", record, force=False)

    def exit(
        self,
        step: Optional[int] = None,
        status: str = "ok",
        reason: Optional[str] = None,
        **fields: Any,
    ) -> bool:
        """Queues the exit receipt: `step` (default: the last step written), `status` ("ok" or
        "failed"), `reason`, with `dropped_receipts_total` and `nulled_values`. Never dropped
        for a full queue. Receipts may still follow it; `close()` (or the interpreter's exit)
        flushes them."""
        if status not in EXIT_STATUSES:
            raise ValueError(f"status must be one of {EXIT_STATUSES}, not {status!r}")
        self._exited = True
        record: Dict[str, Any] = {
            "step": operator.index(step) if step is not None else self.last_step,
            "status": status,
            "reason": reason,
            "dropped_receipts_total": self.dropped,
            "nulled_values": self.nulled,
            **fields,
        }
        return self._emit("exit", record, force=True)

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Waits up to `timeout` seconds for the queued receipts to reach the file, then stops
        the writer; nothing is written after it. Runs at the interpreter's exit too; idempotent."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None:
            return
        atexit.unregister(self.close)
        unwritten = writer.close(timeout)
        if unwritten:
            warn(f"{unwritten} receipts not written to {writer.path} within {timeout:g} s")

    def __enter__(self) -> Receipts:
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if not self._exited:
            if exc is None:
                self.exit(status="ok", reason="completed")
            else:
                self.exit(status="failed", reason=f"{type(exc).__name__}: {exc}")
        self.close()


class StepTimer:
    """Times one step for `Receipts.step_timer`; set its attributes inside the block.

    loss: the training loss (None: not written).
    tokens: tokens this rank processed, when not `tokens_per_step`.
    fields: other fields of the receipt (or use `update`).
    step_time_ms: after the block, the time measured.
    """

    def __init__(self, receipts: Receipts, step: int, synchronize: bool) -> None:
        self.step = operator.index(step)
        self.loss: Optional[float] = None
        self.tokens: Optional[int] = None
        self.fields: Dict[str, Any] = {}
        self.step_time_ms: Optional[float] = None
        self._receipts = receipts
        self._synchronize = synchronize
        self._started = 0.0

    def update(self, **fields: Any) -> None:
        """Adds fields to the step receipt (e.g. `lr=...`, `grad_norm=...`)."""
        self.fields.update(fields)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times a part of the step into the field `<name>_ms`, e.g. `fwd_bwd` or `optimizer`
        (schema v1's names); a phase run twice in one step adds up."""
        started = self._now()
        yield
        elapsed_ms = (self._now() - started) * 1000.0
        key = f"{name}_ms"
        self.fields[key] = self.fields.get(key, 0.0) + elapsed_ms

    def __enter__(self) -> StepTimer:
        self._started = self._now()
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc_type is not None:
            return
        self.step_time_ms = (self._now() - self._started) * 1000.0
        self._receipts.step(
            self.step,
            step_time_ms=self.step_time_ms,
            loss=self.loss,
            tokens=self.tokens,
            **self.fields,
        )

    def _now(self) -> float:
        if self._synchronize:
            _cuda.synchronize(self._receipts._torch, self._receipts._cuda_device)
        return time.perf_counter()


def start(
    *,
    model_flops_per_token: Optional[float] = None,
    tokens_per_step: Optional[int] = None,
    path: Optional[str] = None,
    world_size: Optional[int] = None,
    device: Any = None,
    device_name: Optional[str] = None,
    peak_flops: Optional[float] = None,
    capacity: int = DEFAULT_CAPACITY,
    **fields: Any,
) -> Receipts:
    """Starts the rank's receipts and queues its launch receipt. Call it once, before the
    training loop (it runs git, bounded to a few seconds, and reads versions).

    model_flops_per_token: training FLOPs per token, forward and backward (about 6 x the
        parameters, plus attention), for `mfu`.
    tokens_per_step: tokens ONE RANK processes per optimizer step (micro-batch x sequence
        length x gradient-accumulation steps); receipts report the whole job's, times
        world_size.
    path: the receipts file; default TRAINYARD_RECEIPTS, which trainyard sets for each rank.
        "{rank}" in either is replaced by RANK, so plain torchrun can give each rank its own
        file (TRAINYARD_RECEIPTS=receipts-{rank}.jsonl). With neither, nothing is written
        (said once on stderr) and every method is a no-op.
    world_size: ranks in the job; default WORLD_SIZE.
    device: the rank's CUDA device; default cuda:LOCAL_RANK.
    device_name: the GPU's name for the peak lookup; default torch.cuda.get_device_name.
    peak_flops: the dense bf16 peak of one GPU in FLOP/s, for a GPU the table lacks
        (`trainyard_receipts.peaks`).
    capacity: receipts the queue holds before it drops new ones.
    fields: more fields for the launch receipt (a config, a run name, ...).
    """
    global _started_pid
    # Read once: the bootstrap opens its receipts from its own thread.
    for_bootstrap = _opening_for_bootstrap
    if not for_bootstrap:
        _started_pid = os.getpid()
    environ = os.environ
    rank = _provenance.env_int(environ, "RANK", 0)
    local_rank = _provenance.env_int(environ, "LOCAL_RANK", 0)
    world = world_size if world_size is not None else _provenance.env_int(environ, "WORLD_SIZE", 1)
    path = path or environ.get("TRAINYARD_RECEIPTS")
    if not path:
        _warn_disabled()
        return Receipts(
            None,
            world_size=world,
            tokens_per_step=tokens_per_step,
            model_flops_per_token=model_flops_per_token,
            peak_flops=peak_flops,
        )
    path = path.replace("{rank}", str(rank))

    torch = _provenance.load_torch()
    cuda_device = _cuda.device_index(torch, device, local_rank)
    gpu_name = _cuda.device_name(torch, cuda_device)
    peak_for = device_name or gpu_name
    sku: Optional[str] = None
    unavailable: Optional[str] = None
    if peak_flops is not None:
        sku = "given"
    elif peak_for is None:
        unavailable = "no CUDA device"
    else:
        peak = dense_bf16_peak(peak_for)
        if peak is None:
            unavailable = f"no dense bf16 peak known for {peak_for!r} (pass peak_flops=)"
        else:
            sku, peak_flops = peak
    if unavailable is None and not model_flops_per_token:
        unavailable = "model_flops_per_token not given"

    receipts = Receipts(
        path,
        world_size=world,
        tokens_per_step=tokens_per_step,
        model_flops_per_token=model_flops_per_token,
        peak_flops=peak_flops,
        cuda_device=cuda_device,
        torch=torch,
        capacity=capacity,
        # The bootstrap's are closed by its own exit handler: one of theirs, registered later,
        # would run first and close them before the bootstrap's last receipts (or, while this
        # call is still reading the code's revision in the bootstrap's thread, before the launch
        # receipt), losing them without a word.
        _close_at_exit=not for_bootstrap,
    )
    rev, dirty = _provenance.git_source(_provenance.source_dir(environ))
    launch: Dict[str, Any] = {
        **_provenance.torch_versions(torch),
        "driver": _provenance.driver_version(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "gpu": environ.get("TRAINYARD_GPU"),
        "gpu_uuid": environ.get("TRAINYARD_GPU_UUID"),
        "gpu_pci_bus_id": environ.get("TRAINYARD_GPU_PCI_BUS_ID"),
        "device": gpu_name if gpu_name is not None else ("cpu" if torch is not None else None),
        "source_dir": _provenance.source_dir(environ),
        "source_rev": rev,
        "source_dirty": dirty,
        "env": _provenance.overlay_env(environ),
        "model_flops_per_token": model_flops_per_token,
        "tokens_per_step": tokens_per_step,
        "mfu_sku": sku,
        "mfu_peak_flops": peak_flops,
        "mfu_unavailable": unavailable,
        "producer": f"trainyard_receipts {__version__}",
        **fields,
    }
    receipts._emit("launch", launch, force=True)
    return receipts


def _warn_disabled() -> None:
    global _warned_disabled
    if not _warned_disabled:
        _warned_disabled = True
        warn("TRAINYARD_RECEIPTS is not set and no path was given; receipts are not written")
