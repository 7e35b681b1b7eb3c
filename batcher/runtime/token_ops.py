"""Two per-token ops of a Llama layer in torch, as the model computes them: the definitions the
C kernels (`cpu_kernels.c`, bound in `fused_decode`) reproduce and are checked against, kept once
for the model and the checks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; rotate-half convention (Hugging Face layout): x * cos +
    # [-x2, x1] * sin. `sin` carries the minus (the model's RotaryTables), so the halves only
    # swap: one roll.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 as the reference does, then cast back before the weight (its order of
    # rounding in bf16). F.rms_norm runs the same fp32 steps in one call from Python.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
