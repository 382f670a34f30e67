"""The bootstrap's worker thread: the hooks' queue into one step receipt per iteration.

See `_auto` for what counts as a step; this module applies those rules to the queued events in
order, reads CUDA events once they have completed, and writes the receipts.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from . import _receipts

Mark = Tuple[int, Any]
"""A point in time: (perf_counter_ns, CUDA event or None)."""

EVENT_WAIT_S = 2.0
"""How long a step waits for its CUDA events to complete before its CPU times are used."""


class _Iteration:
    """One training iteration, as the events describe it."""

    __slots__ = ("index", "step", "start", "end", "grad", "values", "sources", "flags", "skipped", "ended_at", "closed")

    def __init__(self, index: int, step: int, start: Mark) -> None:
        self.index = index
        self.step = step
        self.start = start
        self.end: Optional[Mark] = None
        self.grad: Optional[Mark] = None
        self.values: Dict[str, Any] = {}
        self.sources: Dict[str, str] = {}
        self.flags: Set[str] = set()
        self.skipped = False
        self.ended_at = 0.0  # time.monotonic() of its end
        self.closed = False  # the next iteration began: no value can come any more


def _first_step(environ: Any) -> int:
    """The hook's counter starts at 0, or after the resume step of a resumed attempt."""
    if environ.get("TRAINYARD_RESUME") == "1":
        try:
            return int(environ.get("TRAINYARD_RESUME_STEP", "")) + 1
        except ValueError:
            return 0
    return 0


class Worker:
    """Drains `auto.queue` every `TICK_S` on a daemon thread; `finish` runs at exit."""

    def __init__(self, auto: Any) -> None:
        from . import _auto

        self.auto = auto
        self.tick_s = _auto.TICK_S
        self.hold_s = _auto.HOLD_S
        self.first_step = _first_step(os.environ)
        # Wall-clock milliseconds of a perf_counter_ns reading (the hooks read the latter).
        self.wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        self.logs_before_step: Optional[bool] = None
        self.open: Optional[_Iteration] = None
        self.done: List[_Iteration] = []
        self.last_index = -1
        # Values and flags for an iteration that has not begun yet: (its index, values,
        # sources, flags).
        self.pending: Tuple[int, Dict[str, Any], Dict[str, str], Set[str]] = (-1, {}, {}, set())
        self.receipts: Optional[_receipts.Receipts] = None
        self.silent = False  # the script writes receipts itself
        self.written = 0
        self.dropped_steps = 0
        self.late_values = 0
        self.unfinished = 0
        self.dropped_total = 0
        self.failure: Optional[str] = None
        self.lock = threading.Lock()
        self.stopping = False
        self._hook_excepthook()
        atexit.register(self.finish)
        self.thread = threading.Thread(target=self._run, name=_receipts.AUTO_THREAD, daemon=True)
        self.thread.start()

    def _hook_excepthook(self) -> None:
        """Notes an uncaught exception for the exit receipt, then lets the script's own hook
        (or Python's) report it as before."""
        previous = sys.excepthook

        def hook(kind: Any, value: Any, tb: Any) -> None:
            self.failure = f"{kind.__name__}: {value}"
            previous(kind, value, tb)

        sys.excepthook = hook

    def _run(self) -> None:
        while not self.stopping:
            time.sleep(self.tick_s)
            try:
                with self.lock:
                    if not self.stopping:
                        self._tick(final=False)
            except Exception as e:  # never the script's problem
                _receipts.warn(f"bootstrap receipts stopped: {type(e).__name__}: {e}")
                return

    # --- the events, in order ---------------------------------------------------------------

    def _tick(self, final: bool) -> None:
        queue = self.auto.queue
        while queue:
            item = queue.popleft()
            getattr(self, "_on_" + item[0])(*item[1:])
        self._write_ready(final)

    def _on_pre(self, index: int, at: int, ev: Any, prev_end: Optional[Mark]) -> None:
        if self.open is not None and self.open.end is None:
            self.unfinished += 1  # its optimizer step raised: no end, no receipt
        elif self.open is not None:
            self.open.closed = True
            self.done.append(self.open)
        skipped = max(0, index - self.last_index - 1)  # not recorded: the loop outran the bucket
        self.dropped_steps += skipped
        self.dropped_total += skipped
        self.last_index = index
        self.open = it = _Iteration(index, self.first_step + index, prev_end or (at, ev))
        waiting, self.pending = self.pending, (-1, {}, {}, set())
        if waiting[0] == index:
            it.values, it.sources, it.flags = waiting[1], waiting[2], waiting[3]

    def _on_post(self, at: int, ev: Any, grad: Mark) -> None:
        it = self.open
        if it is None:
            return
        it.end = (at, ev)
        it.ended_at = time.monotonic()
        if grad[0] > it.start[0]:
            it.grad = grad

    def _on_skip(self) -> None:
        if self.open is not None:
            self.open.skipped = True

    def _on_flag(self, n: int, ended: bool, what: str) -> None:
        # Its time is in the iteration that ends next: the current one, or the next.
        self._attach(n if ended or n == 0 else n - 1, {}, "", {what})

    def _on_log(self, n: int, inside: bool, any_post: bool, values: Dict[str, Any], source: str) -> None:
        if self.logs_before_step is None and not inside:
            self.logs_before_step = not any_post
        before = self.logs_before_step and not inside
        self._attach(n if before else n - 1, values, source, set())

    def _attach(self, index: int, values: Dict[str, Any], source: str, flags: Set[str]) -> None:
        """Values and flags for iteration `index`: the open one, or one that has not begun."""
        it = self.open
        if it is not None and it.index == index and not it.closed:
            target, sources, into = it.values, it.sources, it.flags
        elif index > self.last_index:
            if self.pending[0] != index:
                self.pending = (index, {}, {}, set())
            _, target, sources, into = self.pending
        else:
            self.late_values += len(values)  # its iteration was written, or not recorded
            return
        into.update(flags)
        for name, value in values.items():
            target[name] = value
            sources[name] = source

    # --- writing ----------------------------------------------------------------------------

    def _write_ready(self, final: bool) -> None:
        now = time.monotonic()
        it = self.open
        if it is not None and it.end is not None and (final or now - it.ended_at >= self.hold_s):
            it.closed = True
            self.done.append(it)
            self.open = None
        while self.done:
            it = self.done[0]
            times = _times(it, wait=not final and now - it.ended_at < EVENT_WAIT_S)
            if times is None:
                return  # its CUDA events have not completed yet
            self.done.pop(0)
            self._write(it, times)

    def _write(self, it: _Iteration, times: Dict[str, Any]) -> None:
        if self.receipts is None and not self._open_receipts():
            return
        from . import _auto

        if _auto.helper_started():
            self.silent = True  # the script began writing its own receipts
            return
        fields = dict(times)
        sources = dict(times.pop("sources"))
        fields.pop("sources")
        assert it.end is not None
        fields["ended_at_ms"] = (it.end[0] + self.wall_offset_ns) // 1_000_000
        from ._loggers import schema_fields

        mapped, own = schema_fields(it.values, it.sources)
        fields.update(own)
        for name, (value, source) in mapped.items():
            fields[name] = value
            sources[name] = source
        fields["sources"] = sources
        if it.flags:
            fields["contains"] = sorted(it.flags)
        if it.skipped:
            fields["skipped"] = True
        if self.dropped_steps:
            fields["dropped_steps"], self.dropped_steps = self.dropped_steps, 0
        assert self.receipts is not None
        if self.receipts.step(it.step, **fields):
            self.written += 1

    def _open_receipts(self) -> bool:
        """The launch receipt, written before the first step receipt: unless the script
        writes receipts itself, in which case the bootstrap stays silent."""
        if self.silent:
            return False
        from . import _auto

        if _auto.helper_started() or _others_write(os.environ.get("TRAINYARD_RECEIPTS", "")):
            self.silent = True
            return False
        torch = self.auto.torch
        on_gpu = False
        try:
            on_gpu = bool(torch.cuda.is_initialized())
        except Exception:
            pass
        _receipts._opening_for_bootstrap = True
        try:
            receipts = _receipts.start(
                device=None if on_gpu else "cpu",
                producer=f"trainyard bootstrap {_receipts.__version__}",
                bootstrap_hash=os.environ.get("TRAINYARD_BOOTSTRAP_HASH"),
                receipts_auto=True,
            )
        finally:
            _receipts._opening_for_bootstrap = False
        self.receipts = receipts  # closed by `finish`, after the last receipts
        return True

    def finish(self) -> None:
        """At exit: every step still held, then the exit receipt."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
            try:
                deadline = time.monotonic() + EVENT_WAIT_S
                self._tick(final=False)
                while self.done and time.monotonic() < deadline:
                    time.sleep(0.01)
                    self._write_ready(final=False)
                self._tick(final=True)
                if self.receipts is None and not self.silent and self.failure is not None:
                    self._open_receipts()
                self.dropped_total += max(0, self.auto.n - 1 - self.last_index)  # after the last recorded
                if self.receipts is not None:
                    self.receipts.exit(
                        None,
                        "failed" if self.failure else "ok",
                        reason=self.failure,
                        steps_written=self.written,
                        dropped_events=self.auto.dropped,
                        late_values=self.late_values,
                        unfinished_steps=self.unfinished,
                        steps_not_recorded=self.dropped_total,
                    )
                    self.receipts.close()
            except Exception as e:
                _receipts.warn(f"bootstrap receipts at exit: {type(e).__name__}: {e}")


AGENT_PRODUCER = "trainyard agent (printed lines)"


def _others_write(path: str) -> bool:
    """Whether the rank's receipts file already holds step receipts the rank wrote by other means
    (a script that writes its own lines, without the helper): then the bootstrap writes none.
    Other kinds a script writes (its own launch record, say) and the agent's receipts from
    printed lines do not count."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
    except OSError:
        return False
    for line in head.splitlines():
        try:
            receipt = json.loads(line)
        except ValueError:
            continue
        if isinstance(receipt, dict) and receipt.get("kind") == "step" and receipt.get("producer") != AGENT_PRODUCER:
            return True
    return False


def _elapsed(a: Mark, b: Mark) -> Tuple[Optional[float], bool]:
    """(milliseconds from a to b, whether CUDA events measured it); None while pending."""
    if a[1] is not None and b[1] is not None:
        try:
            if a[1].query() and b[1].query():
                return float(a[1].elapsed_time(b[1])), True
            return None, True
        except Exception:
            pass
    return (b[0] - a[0]) / 1e6, False


def _times(it: _Iteration, wait: bool) -> Optional[Dict[str, Any]]:
    """`step_time_ms` and `fwd_bwd_ms` of a finished iteration, with their sources; None when
    its CUDA events are pending and `wait`."""
    assert it.end is not None
    out: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for name, mark in (("step_time_ms", it.end), ("fwd_bwd_ms", it.grad)):
        if mark is None:
            continue
        ms, cuda = _elapsed(it.start, mark)
        if ms is None:
            if wait:
                return None
            ms, cuda = (mark[0] - it.start[0]) / 1e6, False
        out[name] = ms
        sources[name] = "cuda_events" if cuda else "cpu_clock"
    out["sources"] = sources
    return out
