"""What the launch receipt records about the process: versions read at run time, the source
revision, the rank environment. Every probe is guarded: a missing library, file or tool gives
None, never an exception.
"""

from __future__ import annotations

import os
import re
import subprocess
from types import ModuleType
from typing import Any, Dict, Mapping, Optional, Tuple

# Seconds each git command may take before the revision is recorded as unknown.
GIT_TIMEOUT_S = 3.0

_DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer environment variable; `default` when unset or not an integer."""
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def load_torch() -> Optional[ModuleType]:
    """torch, imported on first use (free when the script has imported it); None without it."""
    try:
        import torch
    except Exception:  # ImportError, or a broken install failing while it loads
        return None
    return torch


def torch_versions(torch: Optional[ModuleType]) -> Dict[str, Optional[str]]:
    """The `torch`, `cuda` (the toolkit torch was built with) and `nccl` versions of the loaded
    torch; None for each that is unavailable."""
    if torch is None:
        return {"torch": None, "cuda": None, "nccl": None}
    version = getattr(torch, "__version__", None)
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    return {
        "torch": str(version) if version is not None else None,
        "cuda": str(cuda) if cuda is not None else None,
        "nccl": _nccl_version(torch),
    }


def _nccl_version(torch: ModuleType) -> Optional[str]:
    try:
        from torch.cuda import nccl

        version = nccl.version()
    except Exception:  # a CPU-only build, or the library fails to load
        return None
    return nccl_version_string(version)


def nccl_version_string(version: Any) -> Optional[str]:
    """`torch.cuda.nccl.version()` as text: (2, 28, 9) -> "2.28.9", (2, 28, 9, "a0") ->
    "2.28.9+a0"; older torch returned NCCL's integer code (22809, or 2708 before NCCL 2.9)."""
    if isinstance(version, int):
        if version >= 10_000:
            parts = (version // 10_000, version // 100 % 100, version % 100)
        else:
            parts = (version // 1000, version // 100 % 10, version % 100)
        return ".".join(map(str, parts))
    if isinstance(version, (tuple, list)) and len(version) >= 3:
        text = ".".join(map(str, version[:3]))
        suffix = "".join(map(str, version[3:]))
        return f"{text}+{suffix}" if suffix else text
    return None


def driver_version(path: str = _DRIVER_VERSION_FILE) -> Optional[str]:
    """The NVIDIA kernel driver's version from /proc (nvidia-smi is never spawned)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_driver_version(f.readline())
    except OSError:
        return None


def parse_driver_version(first_line: str) -> Optional[str]:
    """The version in the first line of /proc/driver/nvidia/version, for the proprietary
    module ("... x86_64  Kernel Module  550.54.15  Tue Mar ...") and the open one ("... Open
    Kernel Module for x86_64  570.86.15  Release Build ...")."""
    _, found, rest = first_line.partition("Kernel Module")
    match = re.search(r"\b\d+\.\d+(?:\.\d+)*\b", rest) if found else None
    return match.group(0) if match else None


def _git(directory: str, *args: str) -> Optional[str]:
    """stdout of `git [--no-optional-locks] -C directory ARGS`, or None when git is missing,
    fails, or runs past GIT_TIMEOUT_S. No optional locks: a status never takes the index lock
    from a git command the user runs meanwhile."""
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", "-C", directory, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def git_source(directory: str) -> Tuple[Optional[str], Optional[bool]]:
    """(revision, dirty) of the git work tree holding `directory`; (None, None) when it is not
    in one or git is unavailable, and dirty None when `git status` fails or times out."""
    head = _git(directory, "rev-parse", "HEAD")
    if head is None or not head.strip():
        return None, None
    status = _git(directory, "status", "--porcelain")
    return head.strip(), (bool(status.strip()) if status is not None else None)


def source_dir(environ: Mapping[str, str]) -> str:
    """TRAINYARD_SOURCE_DIR, or the working directory when it is unset or empty."""
    return environ.get("TRAINYARD_SOURCE_DIR") or os.getcwd()


def overlay_env(environ: Mapping[str, str]) -> Optional[Dict[str, Optional[str]]]:
    """The job's env overlay as the process sees it: each variable TRAINYARD_ENV_OVERLAY names,
    with its current value (None if the process has unset it). None outside trainyard.

    A PYTHONPATH of the overlay is recorded without the bootstrap's directory, which the agent
    puts first on it (TRAINYARD_BOOTSTRAP_HASH set): the overlay as the job gave it."""
    names = environ.get("TRAINYARD_ENV_OVERLAY")
    if names is None:
        return None
    listed = {name.strip() for name in names.split(",")} - {""}
    out = {name: environ.get(name) for name in sorted(listed)}
    path = out.get("PYTHONPATH")
    if path and environ.get("TRAINYARD_BOOTSTRAP_HASH"):
        boot = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out["PYTHONPATH"] = os.pathsep.join(p for p in path.split(os.pathsep) if os.path.abspath(p or ".") != boot)
    return out
