"""Turning a receipt into one line of strict JSON.

JSON has no NaN or infinity (Python's json writes `NaN`, which makes the whole line invalid and
the agent skips it), and schema v1 has no negative durations or sizes. Such values are written as
null and their field names reported, so the caller can count them. Values that are not JSON types
are converted: scalars with `.item()` (torch and numpy) to Python numbers, anything else to text.
"""

from __future__ import annotations

import json
import math
from typing import Any, List, Mapping, Tuple

# Fields whose values may not be negative (durations and sizes, by their unit suffix).
_NON_NEGATIVE_SUFFIXES = ("_ms", "_bytes")


def encode(record: Mapping[str, Any]) -> Tuple[bytes, List[str]]:
    """The receipt as one line (newline included) and the fields written as null because their
    value was NaN, infinite, or a negative duration or size (nested ones as "a.b", "a[0]")."""
    nulled: List[str] = []
    clean = {str(k): _clean(str(k), v, nulled) for k, v in record.items()}
    if nulled:
        clean["nulled_fields"] = nulled
    line = json.dumps(clean, separators=(",", ":"), allow_nan=False)
    return line.encode("utf-8") + b"\n", nulled


def _clean(name: str, value: Any, nulled: List[str]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _clean(f"{name}.{k}", v, nulled) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(f"{name}[{i}]", v, nulled) for i, v in enumerate(value)]
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            nulled.append(name)
            return None
        if value < 0 and name.endswith(_NON_NEGATIVE_SUFFIXES):
            nulled.append(name)
            return None
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            scalar = item()
        except Exception:  # not a one-element tensor or array
            return str(value)
        if isinstance(scalar, (bool, int, float)):
            return _clean(name, scalar, nulled)
    return str(value)
