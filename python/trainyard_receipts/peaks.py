"""Dense bf16 peaks of NVIDIA data-centre GPUs, the denominator of MFU in receipt schema v1.

MFU is measured against the **dense** bf16 tensor-core peak of one GPU, never the 2:4-sparsity
figure that datasheets print next to it (twice as high). The SKU is matched from the CUDA device
name as `torch.cuda.get_device_name` reports it, e.g. "NVIDIA H100 80GB HBM3" (SXM),
"NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB".
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional


class Peak(NamedTuple):
    """A SKU (e.g. "H100 SXM") and its dense bf16 peak in FLOP/s (not TFLOP/s)."""

    sku: str
    flops: float


# Dense bf16 TFLOP/s per GPU, most specific pattern first (an "H100 NVL" is also an "H100").
# Patterns match whole words of the lower-cased device name, so "RTX A1000" is not an A100.
_DENSE_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"\bh100\b.*\bnvl\b", "H100 NVL", 835.0),
    (r"\bh100\b.*\bpcie\b", "H100 PCIe", 756.0),
    (r"\bh100\b", "H100 SXM", 989.0),
    (r"\bh200\b.*\bnvl\b", "H200 NVL", 835.0),
    (r"\bh200\b", "H200 SXM", 989.0),
    (r"\ba100\b", "A100", 312.0),
    (r"\bl40s\b", "L40S", 362.0),
    (r"\bb200\b", "B200", 2250.0),
)


def dense_bf16_peak(device_name: str) -> Optional[Peak]:
    """The SKU and dense bf16 peak (FLOP/s) of the GPU called `device_name`; None if unknown."""
    name = device_name.lower()
    for pattern, sku, tflops in _DENSE_BF16_TFLOPS:
        if re.search(pattern, name):
            return Peak(sku, tflops * 1e12)
    return None
