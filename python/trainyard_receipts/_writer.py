"""The writer thread: a bounded queue between the training loop and the receipts file.

The training loop only appends encoded lines to an in-memory queue; a daemon thread opens the
file and writes them. A stuck filesystem therefore stalls the thread, never the loop: once the
queue holds `capacity` lines, further lines are refused and the caller counts them as dropped.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Deque, Optional


def warn(message: str) -> None:
    """One line on stderr, prefixed with the package name."""
    print(f"trainyard_receipts: {message}", file=sys.stderr, flush=True)


def _open_append(path: str) -> int:
    """Opens `path` for appending (created if missing). Runs on the writer thread."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _write_line(fd: int, line: bytes) -> None:
    """Writes one whole line: a single `write` on an O_APPEND file, repeated only for the rest
    of a short write."""
    view = memoryview(line)
    while view:
        view = view[os.write(fd, view) :]


class Writer:
    """Appends lines to a file from a daemon thread; `put` never waits for I/O."""

    def __init__(self, path: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.path = path
        self._capacity = capacity
        self._lines: Deque[bytes] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._accepted = 0
        self._done = 0  # written, or given up on after an I/O error
        self._thread = threading.Thread(target=self._run, name="trainyard-receipts", daemon=True)
        self._thread.start()

    def put(self, line: bytes, *, force: bool = False) -> bool:
        """Queues one line; False (nothing queued) when the queue is full or closed. `force`
        queues past the capacity (for the few receipts that must not be lost to a burst)."""
        with self._cond:
            if self._closed or (len(self._lines) >= self._capacity and not force):
                return False
            self._lines.append(line)
            self._accepted += 1
            if len(self._lines) == 1:
                # Woken only when it waits for a first line: a batch of receipts costs one
                # switch to the writer thread, not one each.
                self._cond.notify()
        return True

    def close(self, timeout: float) -> int:
        """Stops taking lines and waits up to `timeout` seconds for the queued ones to be
        written; returns how many are still unwritten (0 when all were)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            return self._accepted - self._done

    def _run(self) -> None:
        fd: Optional[int]
        try:
            fd = _open_append(self.path)
        except OSError as e:
            warn(f"cannot open {self.path} ({e}); receipts are not written")
            fd = None
        failing = False
        try:
            while True:
                with self._cond:
                    while not self._lines and not self._closed:
                        self._cond.wait()
                    if not self._lines:
                        return
                    line = self._lines.popleft()
                if fd is not None:
                    try:
                        _write_line(fd, line)
                        failing = False
                    except OSError as e:
                        if not failing:
                            warn(f"cannot write to {self.path} ({e}); receipts are being lost")
                        failing = True
                with self._cond:
                    self._done += 1
        finally:
            if fd is not None:
                os.close(fd)
