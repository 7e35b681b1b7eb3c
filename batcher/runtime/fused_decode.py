"""Decode steps on the CPU in bf16 with fewer, fused ops.

A one-row decode step of the bundled model is a few hundred microseconds of arithmetic spread
over about 1,600 torch ops, each with its own dispatch cost. C kernels (`cpu_kernels.c`) take
the most numerous of them:
- `rms_norm`: the norm's fp32 round trip (six ops) as one call;
- `attend`: for a step of decode rows only, RoPE on Q and K, the new K and V written to the paged
  cache, and attention over each row's cached blocks read in place, one call per layer in place
  of about twenty ops (slicing, rotation, cache writes, gathers, the mask and SDPA);
- `attend_rotated`: the decode rows of a step that also reads a prompt, attention alone (torch's
  ops rotate and write every row of such a step). So a decode row costs about the same in either
  kind of step, which the step-time model behind admission and chunking assumes;
- `add_rms_norm` (the residual add before a norm) and `silu_mul` (a SwiGLU MLP's activation):
  the ops between the projections, for a plain Llama model's layer loop
  (`batcher.models.llama_layer_loop`), which takes decode-only steps of up to NORM_MAX_ROWS rows.
RoPE, the K/V written and the norm round as torch's ops do (the norm's sum of squares may add in
another order); attention keeps its scores and probabilities in fp32 where torch's bf16 SDPA
rounds some of them, so outputs agree to bf16 rounding, not bit for bit (checked against torch at
load; the greedy tokens of the bundled model in tests/test_fused_decode.py).

Prefill chunks, fp32 models and CUDA keep the torch path; so does a step being traced by
`torch.compile`. `BATCHER_CPU_KERNELS=0` turns the kernels off, to compare.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from batcher.runtime import cpu_kernels
from batcher.runtime.attention import AttentionMetadata, FusedDecodeStep, rotate_and_write_kv
from batcher.runtime.token_ops import apply_rope, rms_norm

log = logging.getLogger("batcher.runtime.fused_decode")

# Norms of up to this many rows run in C (one thread); bigger ones are torch's, on every thread.
NORM_MAX_ROWS = 64
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # as in cpu_kernels.c
# The attention kernel runs on one thread. On 2 cores it beat torch's gather + SDPA on both by
# about 2x at every size measured (1 to 64 rows, 250 to 8k tokens of context: 17 against 45 us
# for one row of 250, 2.8 against 5.6 ms for 16 rows of 2k). With more threads torch's path runs
# in parallel and may win big steps (not measured), so under a bigger thread budget the kernel
# takes only steps whose decode rows read few cached tokens in all.
ONE_THREAD_WINS_UP_TO = 4  # threads
SMALL_STEP_TOKENS = 4096

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class FusedDecode:
    """The kernels, bound to the loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.rms_norm_bf16
        self._norm.argtypes = [_p, _p, _p, _i, _i, _f]
        self._norm.restype = _i
        self._add_norm = lib.add_rms_norm_bf16
        self._add_norm.argtypes = [_p, _p, _p, _p, _i, _i, _f]
        self._add_norm.restype = _i
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.argtypes = [_p, _p, _i, _i]
        self._silu_mul.restype = _i
        self._attend = lib.decode_attention_bf16
        self._attend.argtypes = [_p, _l, _p, _p, _p, _p, _i, _p, _p, _i, _p, _i, _i, _i, _i, _i,
                                 _f, _p]
        self._attend.restype = _i
        self._attend_rotated = lib.paged_decode_attention_bf16
        self._attend_rotated.argtypes = [_p, _l, _p, _p, _i, _p, _i, _p, _i, _i, _i, _i, _i, _f,
                                         _p]
        self._attend_rotated.restype = _i

    @staticmethod
    def takes_norm(x: torch.Tensor) -> bool:
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= NORM_MAX_ROWS
                and x.is_contiguous() and x.device.type == "cpu")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [rows, dim] bf16 contiguous; weight: [dim] bf16."""
        out = torch.empty_like(x)
        if self._norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                      eps):
            raise ValueError(f"rms_norm cannot take {tuple(x.shape)}")
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta in place (x: [rows, dim] bf16 contiguous, as `takes_norm`; delta alike),
        then the norm of the sum: torch's `x = x + delta; rms_norm(x, weight, eps)`."""
        if not (delta.shape == x.shape and delta.dtype == x.dtype and delta.is_contiguous()):
            raise ValueError(f"add_rms_norm takes like rows, got {tuple(delta.shape)} "
                             f"for {tuple(x.shape)}")
        out = torch.empty_like(x)
        if self._add_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
                          x.shape[0], x.shape[1], eps):
            raise ValueError(f"add_rms_norm cannot take {tuple(x.shape)}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * inter] bf16 contiguous -> silu(gate) * up [rows, inter]."""
        rows, width = gate_up.shape
        if not (gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and width % 2 == 0):
            raise ValueError(f"silu_mul takes bf16 rows of gate and up, got {tuple(gate_up.shape)}")
        out = gate_up.new_empty(rows, width // 2)
        if self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2):
            raise ValueError(f"silu_mul cannot take {tuple(gate_up.shape)}")
        return out

    def takes_layer_loop(self, x: torch.Tensor, meta: object) -> bool:
        """A plain model's layer loop (`batcher.models.llama_layer_loop`) runs a step whose
        embedded rows are `x` here: decode rows only, through the fused attention, few enough
        for the single-threaded norms."""
        return (type(meta) is AttentionMetadata and meta.fused is not None
                and meta.num_decodes == x.shape[0] and self.takes_norm(x))

    @staticmethod
    def takes_attention(heads: int, kv_heads: int, head_dim: int) -> bool:
        return (heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
                and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0)

    @staticmethod
    def takes_step(threads: int, cached_tokens: int) -> bool:
        """A step's decode rows, `cached_tokens` in all to read, under a budget of `threads`."""
        return threads <= ONE_THREAD_WINS_UP_TO or cached_tokens <= SMALL_STEP_TOKENS

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], step: FusedDecodeStep,
               heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
        """qkv: [rows, (heads + 2 * kv_heads) * head_dim] (row-strided); cos, sin: [rows, 1,
        head_dim] -> [rows, heads * head_dim]. Writes the rows' new K/V into `kv_cache`."""
        k_cache, v_cache = kv_cache
        rows = qkv.shape[0]
        if not (qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == torch.bfloat16
                and qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("decode attention takes bf16 rows of unit stride")
        out = qkv.new_empty(rows, heads * head_dim)
        if self._attend(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                        step.slots.data_ptr(), step.tables.data_ptr(), step.tables.shape[1],
                        step.lens.data_ptr(), rows, heads, kv_heads, head_dim, step.block_size,
                        head_dim ** -0.5, out.data_ptr()):
            raise ValueError(f"decode attention cannot take {rows} rows of {heads} heads")
        return out

    def attend_rotated(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                       step: FusedDecodeStep) -> torch.Tensor:
        """The decode rows of a mixed step, after torch's ops rotated Q and wrote every row's
        K/V: q [rows, heads, head_dim] (row-strided) -> [rows, heads * head_dim]."""
        k_cache, v_cache = kv_cache
        rows, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if not q.dtype == k_cache.dtype == torch.bfloat16:
            raise ValueError("decode attention takes bf16 queries")
        out = q.new_empty(rows, heads * head_dim)
        if self._attend_rotated(q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                v_cache.data_ptr(), k_cache.shape[0], step.tables.data_ptr(),
                                step.tables.shape[1],
                                step.lens.data_ptr(), rows, heads, k_cache.shape[2], head_dim,
                                step.block_size, head_dim ** -0.5, out.data_ptr()):
            raise ValueError(f"decode attention cannot take {rows} rows of {heads} heads")
        return out


def load(build_dir: Path) -> FusedDecode | None:
    """The kernels, or None (logged) where they cannot be built or do not agree with torch."""
    if os.environ.get("BATCHER_CPU_KERNELS", "1") == "0":
        log.info("fused CPU kernels off (BATCHER_CPU_KERNELS=0): decode steps run torch's ops")
        return None
    try:
        kernels = FusedDecode(cpu_kernels.library(build_dir))
        _check(kernels)
    except (OSError, subprocess.SubprocessError, ValueError, RuntimeError) as exc:
        log.warning("fused CPU kernels unavailable (%s): decode steps run torch's ops", exc)
        return None
    return kernels


def reference_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], step: FusedDecodeStep,
                        heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """What `FusedDecode.attend` computes, in torch ops (the model's own path, row by row)."""
    rows, q_size = qkv.shape[0], heads * head_dim
    q = rotate_and_write_kv(qkv, cos, sin, kv_cache, step.slots, heads, kv_heads, head_dim)
    k_cache, v_cache = kv_cache
    out = []
    for r in range(rows):
        n = int(step.lens[r])
        blocks = step.tables[r, :-(-n // step.block_size)].long()
        kr = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)
        vr = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r].unsqueeze(1), kr, vr, enable_gqa=True)
        out.append(o.reshape(1, q_size))
    return torch.cat(out)


def _check(kernels: FusedDecode) -> None:
    """Both kernels agree with torch on random inputs: a library built from another source, or a
    compiler that miscompiles, never serves."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.rand(64, generator=gen).to(torch.bfloat16)
    want = rms_norm(x, w, 1e-5)
    if not torch.allclose(kernels.rms_norm(x, w, 1e-5).float(), want.float(), rtol=1e-2):
        raise RuntimeError("rms_norm disagrees with torch")
    delta = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    summed = x.clone()
    normed = kernels.add_rms_norm(summed, delta, w, 1e-5)
    if not (torch.equal(summed, x + delta) and torch.allclose(
            normed.float(), rms_norm(x + delta, w, 1e-5).float(), rtol=1e-2)):
        raise RuntimeError("add_rms_norm disagrees with torch")
    gate_up = (4 * torch.randn(3, 2 * 64, generator=gen)).to(torch.bfloat16)
    gate, up = gate_up.split(64, dim=-1)
    if not torch.allclose(kernels.silu_mul(gate_up).float(), (F.silu(gate) * up).float(),
                          rtol=1e-2, atol=1e-3):
        raise RuntimeError("silu_mul disagrees with torch")
    heads, kv_heads, hd, bs = 4, 2, 32, 4
    caches = [(torch.randn(8, bs, kv_heads, hd, generator=gen).to(torch.bfloat16),
               torch.randn(8, bs, kv_heads, hd, generator=gen).to(torch.bfloat16))
              for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    qkv = torch.randn(2, (heads + 2 * kv_heads) * hd, generator=gen).to(torch.bfloat16)
    angle = torch.rand(2, 1, hd // 2, generator=gen)
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(torch.bfloat16)
    step = FusedDecodeStep(kernels, bs, slots=torch.tensor([4 * 5 + 2, 4 * 2 + 0]),
                           tables=torch.tensor([[7, 5, 0], [3, 2, 0]], dtype=torch.int32),
                           lens=torch.tensor([7, 5], dtype=torch.int32))
    got = kernels.attend(qkv, cos, sin, caches[0], step, heads, kv_heads, hd)
    want = reference_attention(qkv, cos, sin, caches[1], step, heads, kv_heads, hd)
    if not (torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            and torch.equal(caches[0][0], caches[1][0])
            and torch.equal(caches[0][1], caches[1][1])):
        raise RuntimeError("decode attention disagrees with torch")
    # The same rows through the entry for rotated queries, over the cache both wrote.
    q = apply_rope(qkv[:, :heads * hd].reshape(2, heads, hd), cos, sin)
    if not torch.allclose(kernels.attend_rotated(q, caches[0], step).float(), want.float(),
                          rtol=2e-2, atol=2e-2):
        raise RuntimeError("decode attention (rotated queries) disagrees with torch")
