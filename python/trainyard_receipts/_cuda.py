"""The rank's CUDA device, read through torch and guarded: on a CPU-only machine, a CPU build
of torch or without torch, every function answers None (or nothing) instead of raising."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Optional


def device_index(torch: Optional[ModuleType], requested: Any, local_rank: int) -> Optional[int]:
    """The CUDA device the rank trains on: `requested` (an index, "cuda:N" or a torch.device)
    when given, else cuda:LOCAL_RANK (trainyard's device rule, and torchrun's convention),
    else the current device. None without a usable CUDA device."""
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        if requested is not None:
            device = torch.device(requested)
            if device.type != "cuda":
                return None
            return device.index if device.index is not None else torch.cuda.current_device()
        if 0 <= local_rank < torch.cuda.device_count():
            return local_rank
        return torch.cuda.current_device()
    except Exception:
        return None


def device_name(torch: Optional[ModuleType], index: Optional[int]) -> Optional[str]:
    """`torch.cuda.get_device_name(index)`, or None."""
    if torch is None or index is None:
        return None
    try:
        return str(torch.cuda.get_device_name(index))
    except Exception:
        return None


def memory(torch: Optional[ModuleType], index: Optional[int]) -> Dict[str, int]:
    """The caching allocator's counters of device `index` as step receipt fields; empty unless
    CUDA is already initialised (reading them never initialises it). The peak is the peak since
    the start or since the script's last `torch.cuda.reset_peak_memory_stats`."""
    if torch is None or index is None:
        return {}
    try:
        if not torch.cuda.is_initialized():
            return {}
        return {
            "mem_allocated_bytes": int(torch.cuda.memory_allocated(index)),
            "mem_reserved_bytes": int(torch.cuda.memory_reserved(index)),
            "mem_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(index)),
        }
    except Exception:
        return {}


def synchronize(torch: Optional[ModuleType], index: Optional[int]) -> None:
    """Waits for the work queued on device `index` (when CUDA is initialised), so that a host
    clock read next covers it."""
    if torch is None or index is None:
        return
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(index)
    except Exception:
        return
