"""Weight-only quantized linears for the CPU: int8 per output row, or int4 in groups of 32 with a
scale and a zero point per group, run by PyTorch's packed kernels.

The packed kernels read a quarter (int4) or half (int8) of bf16's weight bytes, which is what a
batch-1 decode step is bound by; at a few dozen rows they become slower than the dense matmul
(they do not use the wide matrix units). So a layer may keep a dense copy as well and use it for
steps with more rows than `dense_above`: memory for throughput, chosen by `--quantization`. An int4
layer without the copy may instead unpack its weights into a reused dense buffer for steps of
many rows (`batcher.runtime.int4_unpack`, attached by `attach_unpacker`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batcher.runtime.int4_unpack import Int4Unpacker

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # the block size of the GGUF Q4 formats, and the kernel's finest group
# The linears of a decoder layer; the LM head shares its weight with the embedding table.
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Rows up to which a tied LM head (49152 x 576 on the bundled model) runs the packed int8 kernel;
# past them, its dense bf16 copy. The packed kernel's time grows with every row, the dense
# matmul's barely: on a 2-core AMD EPYC (AVX-512 BF16), two threads, int8 vs dense: 1 row 2.3 vs
# 4.7 ms, 4 rows 2.7 vs 3.8, 8 rows 5.8 vs 4.5, 16 rows 11.6 vs 5.6, 32 rows 23.6 vs 7.9 (on a
# 2-core AVX2 CPU, one thread: 1 row 4.3 vs 8.5, 4 rows 6.7 vs 8.5, 8 rows 12.7 vs 9.2).
HEAD_DENSE_ABOVE_ROWS = 4


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [N, K] -> (q int8 [N, K], scale fp32 [N])."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-10) / 127.0
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-row int8 values back in the scales' dtype: q [N, K] int8, scales [N] -> [N, K]. The
    one formula a tied table's lookups and its head's dense copy share."""
    return q.to(scales.dtype) * scales[:, None]


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups along K: w [N, K] -> (q int32 in [0, 15] [N, K],
    scale [N, K / group], minimum [N, K / group]); w ~ q * scale + minimum."""
    n, k = w.shape
    wf = w.float().reshape(n, k // group, group)
    lo = wf.amin(dim=-1)
    hi = wf.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((wf - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                    group: int = INT4_GROUP) -> torch.Tensor:
    n, k = q.shape
    wf = q.reshape(n, k // group, group).float() * scale[..., None] + lo[..., None]
    return wf.reshape(n, k)


class PackedLinear(nn.Module):
    """`y = x @ W.T (+ b)` with W held packed. x: [T, K] in the model's dtype."""

    unpack: Int4Unpacker | None = None  # int4 without a dense copy: see `attach_unpacker`

    def __init__(self, linear: nn.Linear, kind: str, dense_above: int | None):
        super().__init__()
        if kind not in ("int8", "int4"):
            raise ValueError(f"unknown quantization {kind!r}")
        w = linear.weight.detach()
        self.kind = kind
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(),
                                                                  requires_grad=False)
        self.dense_above = dense_above
        if kind == "int8":
            q, scale = quantize_int8(w)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(w.dtype))
            approx = q.float() * scale[:, None]
            # The dense copy holds the quantized values, so both paths compute the same function.
            self.dense = None if dense_above is None else approx.to(w.dtype).contiguous()
        else:
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, "
                                 f"got {self.in_features}")
            self._pack_int4(*quantize_int4(w), w.dtype)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> PackedLinear:
        """A layer from per-row int8 weights (w ~ q * scale; q int8 [N, K], scale [N]), with no
        dense copy."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kind = "int8"
        self.out_features, self.in_features = q.shape
        self.bias = None
        self.dense_above = None
        self.dense = None
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(dtype))
        return self

    @classmethod
    def from_int4(cls, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                  dtype: torch.dtype, dense_above: int | None,
                  bias: torch.Tensor | None = None) -> PackedLinear:
        """A layer from weights already in int4 groups of 32 (w ~ q * scale + lo; q int32 in
        [0, 15] [N, K], scale and lo [N, K / 32]), such as a GGUF file's Q4_1 blocks: no dense
        weight is made unless the layer keeps a dense copy."""
        n, k = q.shape
        if k % INT4_GROUP or scale.shape != (n, k // INT4_GROUP) or lo.shape != scale.shape:
            raise ValueError(f"int4 groups of {INT4_GROUP} do not fit weight {tuple(q.shape)} "
                             f"with scales {tuple(scale.shape)}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kind = "int4"
        self.in_features, self.out_features = k, n
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dense_above = dense_above
        self._pack_int4(q, scale, lo, dtype)
        return self

    def _pack_int4(self, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                   dtype: torch.dtype) -> None:
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel's convention: w = (q - 8) * scale + zero, so zero = lo + 8 * scale;
        # laid out [K / group, N, 2].
        zero = lo.float() + 8.0 * scale.float()
        self.register_buffer("scales", torch.stack([scale.float(), zero], dim=-1)
                             .transpose(0, 1).contiguous().to(dtype))
        # The dense copy holds the quantized values, so both paths compute the same function.
        self.dense = (None if self.dense_above is None else
                      dequantize_int4(q, scale.float(), lo.float()).to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.dense_above:
            return F.linear(x, self.dense, self.bias)
        if self.unpack is not None and x.shape[0] > self.unpack.above_rows:
            y = torch.mm(x, self.unpack.dense_t(self.qweight, self.scales, self.in_features,
                                                self.out_features, INT4_GROUP))
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP,
                                                            self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"{self.kind}, in_features={self.in_features}, "
                f"out_features={self.out_features}, dense_above={self.dense_above}")


def quantize_model(model: nn.Module, kind: str, dense_above: int | None = None) -> int:
    """Replace every decoder-layer linear of `model` with a `PackedLinear` in place. Returns how
    many were replaced. The embedding table (and the LM head tied to it) stay dense."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {kind!r}")
    if kind == "none":
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if name in QUANTIZED_LINEARS and isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        if child.weight.device.type != "cpu":
            raise ValueError("weight-only quantization runs on the CPU only")
        setattr(parent, name, PackedLinear(child, kind, dense_above))
    return len(targets)


def attach_unpacker(model: nn.Module, unpacker: Int4Unpacker) -> int:
    """Let every int4 layer of `model` that keeps no dense copy unpack its weights for steps of
    more than `unpacker.above_rows` rows. Returns how many layers can."""
    n = 0
    for m in model.modules():
        if (isinstance(m, PackedLinear) and m.kind == "int4" and m.dense is None
                and unpacker.fits(m.in_features, m.out_features, INT4_GROUP, m.scales)):
            m.unpack = unpacker
            n += 1
    return n


class Int8Embedding(nn.Module):
    """Embedding rows dequantized on lookup from a per-row int8 table: the same `qweight` and
    `scales` tensors as the tied LM head's `PackedLinear`, so the table exists once."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        if head.kind != "int8":
            raise ValueError("the embedding shares an int8 head's table")
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.register_buffer("qweight", head.qweight)
        self.register_buffer("scales", head.scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8_rows(self.qweight.index_select(0, ids),
                                    self.scales.index_select(0, ids))

    def extra_repr(self) -> str:
        return f"int8, {self.num_embeddings}, {self.embedding_dim}"


def int8_rows_of(rows: Callable[[int, int], torch.Tensor], num_rows: int, width: int,
                 rows_per_slice: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 of a [num_rows, width] matrix read by `rows(start, stop)` a slice at a
    time, so no fp32 copy of the whole is made: (q int8 [num_rows, width], scale fp32)."""
    q = torch.empty((num_rows, width), dtype=torch.int8)
    scale = torch.empty(num_rows, dtype=torch.float32)
    for start in range(0, num_rows, rows_per_slice):
        stop = min(start + rows_per_slice, num_rows)
        q[start:stop], scale[start:stop] = quantize_int8(rows(start, stop))
    return q, scale


def tie_int8_table(model: nn.Module, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   dense_above: int | None = None, rows_per_slice: int = 4096) -> None:
    """Make `model.embed_tokens` and `model.lm_head` one per-row int8 table (w ~ q * scale): the
    head runs the packed int8 kernel on it, the embedding dequantizes only the rows it looks
    up. With `dense_above`, the head also keeps the table's dequantized values densely for steps
    with more rows (the two paths compute the same function, as a layer's dense copy does)."""
    head = PackedLinear.from_int8(q, scale, dtype)
    if dense_above is not None:
        dense = torch.empty(q.shape, dtype=dtype)
        for start in range(0, q.shape[0], rows_per_slice):
            rows = slice(start, start + rows_per_slice)
            dense[rows] = dequantize_int8_rows(q[rows], head.scales[rows])
        head.dense, head.dense_above = dense, dense_above
    model.lm_head = head
    model.embed_tokens = Int8Embedding(head)
