"""The ops between a Llama layer's matmuls as Triton kernels, for CUDA steps in bf16/fp16: RMSNorm
with the residual add folded in, and SwiGLU's SiLU(gate) x up, one launch each where torch's ops
take about seven (the norm's fp32 round trip and the add) and two. A plain Llama model's layer
loop (`batcher.models.llama_layer_loop`) calls them, as it calls the C kernels on the CPU.

They round as torch's ops do, to nearest even (`_round`; bf16 in integer arithmetic, since
Triton's interpreter truncates a float cast to bf16): the residual sum to the activations' type,
the norm's normalised value to that type before the weight's product, and SiLU's output before
the product with up; the norm's sum of squares may add in another order (one step of the type
now and then). Launch shapes depend on tensor shapes only, so the calls capture in CUDA graphs.
`self_check` runs them once on the device in the model's sizes before serving. Imported only
where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batcher.runtime.attention import AttentionMetadata

SILU_BLOCK = 1024


@triton.jit
def _round(x, dtype: tl.constexpr, IS_BF16: tl.constexpr):
    """fp32 values to `dtype`, rounded to nearest even."""
    if IS_BF16:
        u = x.to(tl.uint32, bitcast=True)
        # A NaN stays a NaN (a GPU's 0x7FFFFFFF would carry into the sign bit and round to 0).
        u = tl.where(x != x, 0x7FC00000, u)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, dim, eps,
                     HAS_DELTA: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements in big steps
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the activations' type and kept in x
        d = tl.load(delta_ptr + row * dim + cols, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + d.to(tl.float32), dtype, IS_BF16)
        tl.store(x_ptr + row * dim + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = _round(xf * inv, dtype, IS_BF16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, _round(normed * w, dtype, IS_BF16), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    silu = _round(g / (1.0 + tl.exp(-g)), dtype, IS_BF16).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, _round(silu * u.to(tl.float32), dtype, IS_BF16),
             mask=mask)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    if x.dim() != 2 or not x.is_contiguous() or (delta is not None and (
            delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous())):
        raise ValueError(f"the norm takes contiguous [rows, dim] rows, got {tuple(x.shape)}")
    rows, dim = x.shape
    out = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, x if delta is None else delta, weight, out, dim, eps,
                                  HAS_DELTA=delta is not None,
                                  IS_BF16=x.dtype == torch.bfloat16,
                                  BLOCK=triton.next_power_of_2(dim))
    return out


class TritonLayerOps:
    """The layer loop's ops on a GPU: every step of rows in a reduced-precision type.
    `device_type` is the device whose steps it takes ("cpu" only to run the loop through
    Triton's interpreter in tests)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type

    def takes_layer_loop(self, x: torch.Tensor, meta: object) -> bool:
        return (isinstance(meta, AttentionMetadata) and x.device.type == self.device_type
                and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
                and x.is_contiguous())

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _norm(x, None, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta in place, then the norm of the sum."""
        return _norm(x, delta, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * inter] contiguous -> silu(gate) * up [rows, inter]."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous() or width % 2:
            raise ValueError(f"silu_mul takes rows of gate and up, got {tuple(gate_up.shape)}")
        inter = width // 2
        out = gate_up.new_empty(rows, inter)
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, SILU_BLOCK))](
                gate_up, out, inter, IS_BF16=gate_up.dtype == torch.bfloat16, BLOCK=SILU_BLOCK)
        return out


def self_check(device: torch.device, dtype: torch.dtype, hidden: int,
               intermediate: int) -> str | None:
    """Run the kernels once on random rows in the model's sizes and compare them with torch's
    ops: None when they agree, else why not (the model then keeps its modules' path)."""
    import torch.nn.functional as F

    from batcher.runtime.token_ops import rms_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, hidden, generator=gen).to(dtype)
    delta = torch.randn(3, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    gate_up = (3 * torch.randn(3, 2 * intermediate, generator=gen)).to(dtype)
    ops = TritonLayerOps(device.type)
    try:
        summed = x.to(device, copy=True)
        normed = ops.add_rms_norm(summed, delta.to(device), w.to(device), 1e-5).cpu()
        plain = ops.rms_norm(x.to(device), w.to(device), 1e-5).cpu()
        swiglu = ops.silu_mul(gate_up.to(device)).cpu()
    except Exception as exc:  # a compiler or driver that refuses a kernel
        return f"{type(exc).__name__}: {exc}"
    gate, up = gate_up.split(intermediate, dim=-1)
    checks = {"the residual add": (summed.cpu(), x + delta),
              "the norm": (plain, rms_norm(x, w, 1e-5)),
              "the add and norm": (normed, rms_norm(x + delta, w, 1e-5)),
              "SiLU x up": (swiglu, F.silu(gate) * up)}
    for name, (got, want) in checks.items():
        if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2):
            err = (got.float() - want.float()).abs().max().item()
            return f"{name} differs from torch's ops by {err:.3g}"
    return None
