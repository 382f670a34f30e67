"""What a script already reports, observed where its loggers are called, and named as schema v1
names them. Observing only: each wrapper calls the logger's own method first, with the same
arguments, returns what it returned, and then notes the numbers; the user's wandb run, MLflow
run and event files are exactly what they would be without trainyard.

Observed entry points (the ones scripts and their frameworks really call):
- wandb: `wandb.sdk.wandb_run.Run.log` (reached by `wandb.log` and Lightning's WandbLogger);
- MLflow: `MlflowClient.log_metric` and `log_batch` (reached by `mlflow.log_metric(s)` and
  Lightning's MLFlowLogger);
- TensorBoard: `SummaryWriter.add_scalar` of `torch.utils.tensorboard` and of `tensorboardX`;
- Hugging Face transformers: `Trainer.log` (what its callbacks, the printed dict among them, are
  given), on every rank that calls it; the summary at the end of training (`train_runtime`, a
  `train_loss` averaged over the run) is not a step's;
- torch: `GradScaler.step` (a skipped step), `torch.save` (a checkpoint), `Module.eval()` (an
  evaluation), `Optimizer.__init__` (its parameters get the gradient hook).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Dict, Tuple

# Logged names (lower case, the last path part, a `train` prefix dropped) -> schema v1 names.
_NAMES = {
    "loss": "loss",
    "lm loss": "loss",
    "lm_loss": "loss",
    "loss_step": "loss",
    "lr": "lr",
    "learning_rate": "lr",
    "learning-rate": "lr",
    "grad_norm": "grad_norm",
    "grad-norm": "grad_norm",
    "gradient_norm": "grad_norm",
    "total_norm": "grad_norm",
    "tokens_per_s": "tokens_per_s",
    "tokens_per_sec": "tokens_per_s",
    "tokens_per_second": "tokens_per_s",
    "tok/sec": "tokens_per_s",
    "tok_per_sec": "tokens_per_s",
    "tps": "tokens_per_s",
    "mfu": "mfu",
    "bf16_mfu": "mfu",
    "mfu(%)": "mfu",
    "mfu_pct": "mfu",
}
_LR = re.compile(r"^lr-[a-z0-9_]+$")  # Lightning's LearningRateMonitor: lr-AdamW
_RESERVED = {"kind", "schema", "step", "created_at_ms", "step_time_ms", "fwd_bwd_ms", "sources",
             "contains", "skipped", "tokens", "dropped_steps", "dropped_receipts"}


def schema_name(logged: str) -> str:
    """The schema v1 name of a logged metric, or "" when it has none."""
    name = logged.strip().lower()
    last = name.rsplit("/", 1)[-1]
    for candidate in (name, last, last.removeprefix("train_"), last.removeprefix("train-")):
        if candidate in _NAMES:
            return _NAMES[candidate]
    if _LR.match(last) or last.startswith("lr-"):
        return "lr"
    return ""


def schema_fields(values: Dict[str, Any], sources: Dict[str, str]) -> Tuple[Dict[str, Tuple[float, str]], Dict[str, float]]:
    """(schema v1 fields with their sources, other numbers under their own names) of the values
    logged in one step. An MFU above 1 is a percentage and becomes a fraction; a name that would
    replace a field of the receipt itself is kept as `logged.NAME`."""
    mapped: Dict[str, Tuple[float, str]] = {}
    own: Dict[str, float] = {}
    for logged, raw in values.items():
        value = _number(raw)
        if value is None:
            continue
        name = schema_name(logged)
        if name:
            if name == "mfu" and value > 1.0:
                value /= 100.0
            if name not in mapped or logged.lower() == name:  # the plain name wins
                mapped[name] = (value, sources.get(logged, "logged"))
        else:
            own[f"logged.{logged}" if logged in _RESERVED else logged] = value
    return mapped, own


def _number(raw: Any) -> Any:
    """A logged value as a finite float, None for anything else (images, tables, text). A
    one-element tensor is read here, on the worker thread, never on the script's."""
    try:
        if hasattr(raw, "numel") and raw.numel() == 1:
            raw = raw.item()
        if isinstance(raw, bool):
            return None
        value = float(raw)
    except Exception:
        return None
    return value if math.isfinite(value) else None


def _after(cls: Any, method: str, note: Callable[..., None]) -> None:
    """Wraps `cls.method` so that `note(*args, **kwargs)` runs after it returned."""
    real = getattr(cls, method, None)
    if real is None or getattr(real, "_trainyard", False):
        return

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        try:
            note(*args, **kwargs)
        except Exception:
            pass
        return result

    wrapper._trainyard = True  # type: ignore[attr-defined]
    setattr(cls, method, wrapper)


def observe(what: str, module: Any, log: Callable[[Dict[str, Any], str], None]) -> None:
    """Wraps the logging entry points of `module` (imported as `what`)."""
    if what == "wandb":
        def run_log(run: Any, data: Any = None, *args: Any, **kwargs: Any) -> None:
            if isinstance(data, dict):
                log(dict(data), "wandb")

        _after(module.Run, "log", run_log)
    elif what == "mlflow":
        def log_metric(client: Any, run_id: Any, key: str, value: Any, *args: Any, **kwargs: Any) -> None:
            log({key: value}, "mlflow")

        def log_batch(client: Any, run_id: Any, metrics: Any = (), *args: Any, **kwargs: Any) -> None:
            found = {m.key: m.value for m in metrics or () if hasattr(m, "key")}
            if found:
                log(found, "mlflow")

        _after(module.MlflowClient, "log_metric", log_metric)
        _after(module.MlflowClient, "log_batch", log_batch)
    elif what == "transformers":
        def trainer_log(trainer: Any, logs: Any = None, *args: Any, **kwargs: Any) -> None:
            if isinstance(logs, dict) and "train_runtime" not in logs:
                log(dict(logs), "transformers")

        _after(module.Trainer, "log", trainer_log)
    elif what in ("tensorboard", "tensorboardX"):
        def add_scalar(writer: Any, tag: str, scalar_value: Any, *args: Any, **kwargs: Any) -> None:
            log({tag: scalar_value}, what)

        _after(module.SummaryWriter, "add_scalar", add_scalar)


def observe_torch(torch: Any, auto: Any) -> None:
    """GradScaler skips, checkpoints and evaluations, for the step they happen in."""
    try:
        scaler = torch.amp.GradScaler
        real_step = scaler.step

        @functools.wraps(real_step)
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = auto.pre_count
            result = real_step(self, optimizer, *args, **kwargs)
            if auto.pre_count == before:
                auto.scaler_skipped(optimizer)
            return result

        scaler.step = step
    except Exception:
        pass
    _after(torch, "save", lambda *a, **k: auto.flag("checkpoint"))
    _after(torch.optim.Optimizer, "__init__", lambda opt, *a, **k: auto.created(opt))
    # `Module.eval()` of the model, not `Module.train`, which every `model.train()` calls once per
    # submodule (a wrapper there cost a Hugging Face run of a 12-layer GPT-2 a few hundred
    # microseconds a step); `eval()` calls `train(False)` on the children directly.
    _after(torch.nn.Module, "eval", lambda m, *a, **k: auto.flag("eval"))
