"""Where the GPU time of a training step goes in PyTorch, eager or torch.compile'd: the model of
engine/reference/gpt_ref.py (the engine's model, op for op) run under torch.profiler, and the
kernels that took the most GPU time. The engine launches the same libtorch kernels as eager
PyTorch except where it has its own (the fused loss), so this is the map of what to fuse next.

    python3 deploy/gpu/profile_ref.py [--trace PATH] -- GPT_REF_ARGS...

GPT_REF_ARGS are gpt_ref.py's own (weights, depth, shards, batch, --compile...). Prints the top 40
kernels by GPU time over the last steps (after 3 warm-up steps); with --trace, also writes those
steps as a Chrome trace, which deploy/gpu/trace_table.py sums as it does the engine's own
(--profile-steps).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine/reference"))
import gpt_ref  # noqa: E402

WARM = 3


def main():
    argv = sys.argv[1:]
    trace = None
    if "--" in argv:
        ours, argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        if "--trace" in ours:
            trace = ours[ours.index("--trace") + 1]
    steps = [0]
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=0, warmup=WARM, active=1000))
    real_schedules = gpt_ref.schedules

    # gpt_ref's loop calls schedules() once per step, before the optimizer: the step boundary.
    def schedules(a, it):
        if steps[0] > 0:
            prof.step()
        steps[0] += 1
        return real_schedules(a, it)

    gpt_ref.schedules = schedules
    sys.argv = ["gpt_ref.py", *argv]
    with prof:
        gpt_ref.main()
    profiled = max(steps[0] - 1 - WARM, 1)
    print(f"# {profiled} profiled steps; times are totals over them", file=sys.stderr)
    if trace:
        prof.export_chrome_trace(trace)
    table = prof.key_averages()
    try:
        text = table.table(sort_by="device_time_total", row_limit=40, max_name_column_width=90)
    except (KeyError, AttributeError, ValueError):
        text = table.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    print(text, file=sys.stderr)


if __name__ == "__main__":
    main()
