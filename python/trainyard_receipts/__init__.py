"""Receipts for trainyard from any PyTorch training script: standard library only, never
blocking the training loop.

    import trainyard_receipts as ty

    receipts = ty.start(model_flops_per_token=6 * n_params, tokens_per_step=batch * seq_len)
    for step in range(steps):
        with receipts.step_timer(step) as s:
            loss = train_step()
            s.loss = loss.item()
    receipts.exit(step, "ok")

`start()` writes the launch receipt (versions read at run time, source revision, the job's env
overlay, the GPU and its dense bf16 peak); `step_timer` (or `Receipts.step` with a time you
measured) writes step receipts with `step_time_ms`, `tokens_per_s`, `mfu` and memory; `eval`,
`checkpoint` and `exit` write theirs. Receipts follow schema v1 (docs/receipts.md of trainyard)
and go to the file TRAINYARD_RECEIPTS names, through a bounded queue drained by a daemon thread.
"""

from ._receipts import (
    DEFAULT_CAPACITY,
    DEFAULT_CLOSE_TIMEOUT_S,
    SCHEMA_VERSION,
    Receipts,
    StepTimer,
    start,
)
from ._version import __version__
from .peaks import Peak, dense_bf16_peak

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "SCHEMA_VERSION",
    "Peak",
    "Receipts",
    "StepTimer",
    "__version__",
    "dense_bf16_peak",
    "start",
]
