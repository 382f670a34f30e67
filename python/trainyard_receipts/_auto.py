"""Step receipts of a script that does not call this package: what the bootstrap
(`sitecustomize`, which trainyard puts on a rank's path) runs once the script imports torch.

Two halves, so that the training loop pays only for timestamps:

- **the hooks** (the script's threads): torch's global optimizer step hooks, a
  post-accumulate-grad hook on the parameters the optimizers hold, and observers of the loggers
  the script calls (`_loggers`). Each appends a small tuple to a queue: a monotonic clock
  reading, and on a GPU a CUDA event recorded on the current stream. Nothing is encoded,
  written or synchronised there.
- **the worker** (a daemon thread): every `TICK_S` it drains the queue, turns it into one
  receipt per training iteration, reads the CUDA events once they have completed (never waiting
  for them), and writes through the same `Receipts` writer the helper uses.

What counts as one step (docs/receipts.md, "Receipts without code changes"):
- an iteration begins when the first optimizer ever seen (the leader) begins a step outside any
  other optimizer's step; several optimizers stepped in one iteration, gradient accumulation,
  and an optimizer that steps its parent's or inner optimizers' `step` (nested) are one step;
- a `GradScaler` step that skipped the optimizer (inf or NaN gradients) is a step, flagged
  `skipped`;
- the step's time runs from the end of the previous step (its last optimizer's post-hook) to
  the end of this one; step 0 from its first pre-hook. `fwd_bwd_ms` runs from the end of the
  previous step to the moment the last gradient was accumulated locally, this rank's own
  compute, which collectives do not make equal across ranks;
- values logged while an optimizer steps belong to that step; values logged between two steps
  belong to the step before them, unless the script logged before its first optimizer step,
  which shows it logs before `opt.step()`: then they belong to the step after them.

Under `torch.compile` of the optimizer step the hooks still fire every step. Dynamo cannot trace
a clock read, so it runs the step's wrapper (where torch's own optimizer code already breaks the
graph, before and after the update) in Python up to the update itself: the compiled graphs are
the same ones, none is compiled again, and the graph breaks are no more than without the hooks
(python/tests/test_auto.py). A hook that returns early under `torch.compiler.is_compiling()`
would fire zero times, so these do not.

Where the guess fails: a GAN whose critic steps several times per generator step (each critic
step begins an iteration if the critic was the first optimizer seen), and an optimizer created
mid-run that steps before the leader in an iteration.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from . import _loggers

TICK_S = 0.1
"""How often the worker drains the queue (each time it takes the interpreter from the script:
ten times a second, not twenty)."""
HOLD_S = 1.0
"""How long a finished step waits for the next one (to collect values logged after it) before
it is written anyway: receipts stay live within 2 s of their step."""
MAX_QUEUED = 100_000
"""Events the queue holds; beyond it events are dropped and counted, the loop never waits."""
MAX_RECEIPTS_PER_S = 500
"""Step receipts written per second, on average, at most; bursts of up to `BURST_RECEIPTS`. The
hooks themselves decide which iterations are recorded (a token bucket): a faster loop has the
others counted in `dropped_steps`, so the worker, which shares the script's interpreter, does a
bounded amount of work whatever the loop's rate."""
BURST_RECEIPTS = 500.0
_TOKENS_PER_NS = MAX_RECEIPTS_PER_S / 1e9
_clock = time.perf_counter_ns
_getframe = sys._getframe

_state: Optional["_Auto"] = None


def imported(what: str, module: Any) -> None:
    """The bootstrap saw the script import `what` ("torch", "wandb", ...)."""
    global _state
    if what == "torch":
        if _state is None and not _is_launcher():
            _state = _Auto(module)
        return
    if _state is not None:
        _loggers.observe(what, module, _state.log)


def _finished(frame: Any) -> bool:
    """Whether a frame has returned (or raised): only a frame still executing refuses to be
    cleared. Clearing a finished one frees what it held."""
    if frame is None:
        return False
    try:
        frame.clear()
        return True
    except RuntimeError:
        return False


def _is_launcher() -> bool:
    """torchrun, `python -m torch.distributed.run` (or `.launch`): its workers are the ranks.
    Read from the interpreter's own command line: with `-m`, torch is imported while the
    package is found, before `sys.argv` names the module."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if any(os.path.basename(a) == "torchrun" for a in argv[:2]):  # the console script
        return True
    modules = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"]
    if any(m in ("torch.distributed.run", "torch.distributed.launch") for m in modules):
        return True
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0.replace("\\", "/").endswith(("torch/distributed/run.py", "torch/distributed/launch.py"))


def helper_started() -> bool:
    """Whether this process writes receipts itself through `trainyard_receipts.start()`."""
    from . import _receipts

    return _receipts.started_in_process()


class _Auto:
    """The hooks and the queue they feed (see the module's doc)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.queue: Deque[Tuple[Any, ...]] = collections.deque()
        self.dropped = 0
        # The optimizers stepping now, outermost first: (id, the frame of its step's wrapper).
        self.depth: List[Tuple[int, Any]] = []
        self.last_grad: Tuple[int, Any] = (0, None)
        self.grad_handles: Dict[int, Any] = {}  # id(param) -> handle, until learned
        self.hooked: set = set()  # ids of the optimizers whose parameters are hooked
        self.grad_param: Optional[int] = None  # the parameter whose gradient comes last
        self.grads_seen: List[int] = []
        self.leader: Optional[int] = None
        self.n = 0  # iterations begun (the next one's index)
        self.ended = False  # the current iteration had its last optimizer's post-hook
        self.any_post = False
        self.sampled = False  # the current iteration is recorded
        self.tokens = float(BURST_RECEIPTS)  # the token bucket of recorded iterations
        self.refilled_ns = time.perf_counter_ns()
        self.last_end: Optional[Tuple[int, Any]] = None  # the end of the previous iteration
        self.pre_count = 0  # every pre-hook, nested ones too (a GradScaler step that stepped)
        self.cuda = False
        self.optimizers: List[Any] = []  # weak references to every optimizer created
        os.environ["TRAINYARD_RECEIPTS_OWNER"] = f"{os.getpid()}:{os.environ.get('RANK', '')}"
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        register_optimizer_step_pre_hook(self._pre)
        register_optimizer_step_post_hook(self._post)
        _loggers.observe_torch(torch, self)
        from ._worker import Worker

        self.worker = Worker(self)

    # --- the hook path: a clock reading, maybe an event, one append --------------------------

    def _push(self, item: Tuple[Any, ...]) -> None:
        if len(self.queue) < MAX_QUEUED:
            self.queue.append(item)
        else:
            self.dropped += 1

    def _event(self) -> Any:
        if not self.cuda:
            return None
        try:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        except Exception:
            self.cuda = False
            return None

    def _pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        # The hook path, written for speed (locals, no call it can avoid): about 1 us with
        # _post, python/bench_hooks.py.
        key = id(opt)
        self.pre_count += 1
        depth = self.depth
        if depth and _finished(depth[0][1]):
            depth.clear()  # a step raised before its post-hook: it is over
        depth.append((key, _getframe(1)))  # the frame of the optimizer's step wrapper
        if len(depth) > 1:
            return  # nested: a parent's or an inner optimizer's step
        if key != self.leader and not self._first_sight(key, opt):
            return
        self._iteration(_clock())

    def _first_sight(self, key: int, opt: Any) -> bool:
        """An optimizer other than the leader begins a step at depth 0: hook its parameters if
        new; it leads when it is the first seen."""
        if self.leader is None:
            self.leader = key
            self._learn_cuda(opt)
        if key not in self.hooked:
            self._hook_grads(opt)
        return key == self.leader

    def _post(self, opt: Any, args: Any, kwargs: Any) -> None:
        depth = self.depth
        if depth and depth[-1][0] == id(opt):
            depth.pop()
        if depth:
            return
        now = _clock()
        ev = self._event() if self.cuda else None
        self.last_end = (now, ev)
        self.ended = self.any_post = True
        if self.sampled:
            self._push(("post", now, ev, self.last_grad))

    def created(self, opt: Any) -> None:
        """An optimizer was made: its parameters get the gradient hook (outside any compiled
        region, where hooks can be registered)."""
        import weakref

        try:
            self.optimizers.append(weakref.ref(opt))
        except TypeError:
            pass
        if id(opt) not in self.hooked:
            self._hook_grads(opt)

    def _iteration(self, now: int) -> None:
        """A new iteration begins (its index is `self.n`)."""
        index = self.n
        self.n = index + 1
        if index == 2:
            self._keep_last_grad_hook()
        self.ended = False
        tokens = self.tokens + (now - self.refilled_ns) * _TOKENS_PER_NS
        self.refilled_ns = now
        if tokens > BURST_RECEIPTS:
            tokens = BURST_RECEIPTS
        if tokens < 1.0:
            self.tokens = tokens
            self.sampled = False
            return
        self.tokens = tokens - 1.0
        self.sampled = True
        first = self._event() if self.cuda and self.last_end is None else None  # step 0's start
        self._push(("pre", index, now, first, self.last_end))

    def _ended(self, now: int) -> None:
        """The last optimizer of the iteration ended its step (so far)."""
        ev = self._event()
        self.last_end = (now, ev)
        self.ended = self.any_post = True
        if self.sampled:
            self._push(("post", now, ev, self.last_grad))

    def _grad(self, param: Any) -> None:
        self.last_grad = (time.perf_counter_ns(), self._event() if self.grad_param is not None else None)
        if self.grad_param is None:
            self.grads_seen.append(id(param))

    def scaler_skipped(self, opt: Any) -> None:
        """A GradScaler step that did not step `opt` (inf or NaN gradients): an iteration of its
        own when `opt` leads, flagged `skipped`."""
        key = id(opt)
        if self.leader is None:
            self.leader = key
        if key == self.leader:
            self._iteration(time.perf_counter_ns())
        if self.sampled:
            self._push(("skip",))
        self._ended(time.perf_counter_ns())

    def flag(self, what: str) -> None:
        """An evaluation or a checkpoint happened now."""
        self._push(("flag", self.n, self.ended, what))

    def log(self, values: Dict[str, Any], source: str) -> None:
        """Values the script logged through `source` (wandb, mlflow, tensorboard, ...)."""
        self._push(("log", self.n, bool(self.depth), self.any_post, values, source))

    # --- set-up, off the steady path -----------------------------------------------------------

    def _learn_cuda(self, opt: Any) -> None:
        if opt is None:
            return
        try:
            first = next(p for g in opt.param_groups for p in g["params"])
            self.cuda = bool(first.is_cuda) and self.torch.cuda.is_initialized()
        except Exception:
            self.cuda = False

    def _hook_grads(self, opt: Any) -> None:
        self.hooked.add(id(opt))
        if self.grad_param is not None:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in self.grad_handles or not getattr(p, "requires_grad", False):
                    continue
                try:
                    self.grad_handles[id(p)] = p.register_post_accumulate_grad_hook(self._grad)
                except Exception:
                    return  # torch < 2.1: no per-rank compute time

    def _keep_last_grad_hook(self) -> None:
        """After two iterations the parameter whose gradient comes last is known: keep its hook
        alone (one call a step instead of one per parameter)."""
        if not self.grads_seen:
            return
        last = self.grads_seen[-1]
        for key, handle in list(self.grad_handles.items()):
            if key != last:
                handle.remove()
                del self.grad_handles[key]
        self.grad_param = last
        self.grads_seen = []
