"""The ops between a Llama layer's matmuls as Triton kernels, for CUDA steps in bf16/fp16: RMSNorm
with the residual add folded in, and SwiGLU's SiLU(gate) x up, one launch each where torch's ops
take about seven (the norm's fp32 round trip and the add) and two. A plain Llama model's layer
loop (`batcher.models.llama_layer_loop`) calls them, as it calls the C kernels on the CPU.
In a step whose attention runs on the Triton kernels, RoPE on Q and K and the new K/V's cache
write are one launch too (`rope_cache`), where torch's ops take about six (the roll, two
products, the sum, two slot copies); the attention kernels then read every key from the cache.

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

from batcher.runtime.attention import AttentionMetadata, reads_cache_only, rotate_and_write_kv

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


@triton.jit
def _rope_cache_kernel(qkv_ptr, qkv_stride, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr,
                       v_cache_ptr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, IS_BF16: tl.constexpr):
    # One program per (row, head) of Q, K and V in turn: Q and K heads rotated (x * cos +
    # roll(x, half) * sin, each product and the sum rounded as torch rounds them; `sin` carries
    # the rotate-half minus), Q to `q`, K and V to the row's cache slot.
    dtype = q_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    src = qkv_ptr + row * qkv_stride + head * HEAD_DIM
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if head < HEADS + KV_HEADS:
        half = HEAD_DIM // 2
        x = tl.load(src + d).to(tl.float32)
        rolled = tl.load(src + tl.where(d < half, d + half, d - half)).to(tl.float32)
        c = tl.load(cos_ptr + row * HEAD_DIM + d).to(tl.float32)
        s = tl.load(sin_ptr + row * HEAD_DIM + d).to(tl.float32)
        y = _round(_round(x * c, dtype, IS_BF16).to(tl.float32)
                   + _round(rolled * s, dtype, IS_BF16).to(tl.float32), dtype, IS_BF16)
        if head < HEADS:
            tl.store(q_ptr + (row * HEADS + head) * HEAD_DIM + d, y)
        else:
            tl.store(k_cache_ptr + (slot * KV_HEADS + head - HEADS) * HEAD_DIM + d, y)
    else:
        v = tl.load(src + d)
        tl.store(v_cache_ptr + (slot * KV_HEADS + head - HEADS - KV_HEADS) * HEAD_DIM + d, v)


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
    def takes_head_dim(head_dim: int) -> bool:
        return head_dim >= 2 and head_dim & (head_dim - 1) == 0

    @staticmethod
    def takes_rope_cache(meta: AttentionMetadata, rows: int, head_dim: int) -> bool:
        """A step whose attention reads every key from the cache through the Triton kernels
        (`attention.reads_cache_only`), in heads of a power-of-two size."""
        return TritonLayerOps.takes_head_dim(head_dim) and reads_cache_only(meta, rows)

    @staticmethod
    def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
        """qkv: [rows, (heads + 2 * kv_heads) * head_dim], unit stride within a row; cos, sin:
        [rows, 1, head_dim] contiguous; slots: [rows] -> Q rotated, [rows, heads, head_dim]. K
        rotated and V are written to `kv_cache` ([blocks, block_size, kv_heads, head_dim]) at
        each row's slot."""
        k_cache, v_cache = kv_cache
        rows = qkv.shape[0]
        if not (qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
                and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == sin.numel() == rows * head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.shape[-2:] == (kv_heads, head_dim) and slots.shape == (rows,)):
            raise ValueError(f"rope_cache cannot take qkv {tuple(qkv.shape)} in heads of "
                             f"{head_dim}")
        q = qkv.new_empty(rows, heads, head_dim)
        if rows:
            _rope_cache_kernel[(rows, heads + 2 * kv_heads)](
                qkv, qkv.stride(0), cos, sin, slots, q, k_cache, v_cache, HEADS=heads,
                KV_HEADS=kv_heads, HEAD_DIM=head_dim, IS_BF16=qkv.dtype == torch.bfloat16)
        return q

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
    """Run the norm and SwiGLU kernels once on random rows in the model's sizes and compare them
    with torch's ops: None when they agree, else why not (the model then keeps its modules'
    path)."""
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


def check_rope_cache(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                     head_dim: int) -> str | None:
    """Run `rope_cache` once on random rows in the model's attention shape and compare it with
    torch's ops: None when it is equal bit for bit, else why not (steps then keep
    `Attention.attend`)."""
    if not TritonLayerOps.takes_head_dim(head_dim):
        return f"heads of {head_dim} (it takes a power of two)"
    gen = torch.Generator().manual_seed(1)
    rows, blocks, block_size = 3, 4, 2
    qkv = (3 * torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)).to(dtype)
    angle = torch.rand(rows, 1, head_dim, generator=gen) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots = torch.tensor([5, 0, 2])
    want_cache = tuple(torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype)
                       for _ in range(2))
    want = rotate_and_write_kv(qkv, cos, sin, want_cache, slots, heads, kv_heads, head_dim)
    cache = tuple(c.to(device, copy=True) for c in want_cache)
    cache[0].zero_()
    cache[1].zero_()
    try:
        got = TritonLayerOps.rope_cache(qkv.to(device), cos.to(device), sin.to(device), cache,
                                        slots.to(device), heads, kv_heads, head_dim).cpu()
    except Exception as exc:  # a compiler or driver that refuses a kernel
        return f"{type(exc).__name__}: {exc}"
    if not (torch.equal(got, want) and torch.equal(cache[0].cpu(), want_cache[0])
            and torch.equal(cache[1].cpu(), want_cache[1])):
        return "RoPE and the cache write differ from torch's ops"
    return None
