"""Small host values (per-row parameters, index lists) onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from ordinary host memory, and torch then waits for
the stream: for everything queued before it, the step still running included. A step launched
while the one before it runs would wait for that one to end. From pinned memory (torch's caching
host allocator, which keeps a block until the copies from it have run) the copy is queued in
stream order and the host goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`, queued, not waited for, on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
