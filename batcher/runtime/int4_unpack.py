"""Dense bf16 weights of an int4 layer, unpacked per step, for steps with many rows.

PyTorch's packed int4 kernel unpacks a layer's weights again for every four rows it multiplies, so
a prefill chunk of a few hundred rows costs it far more than a dense matmul. A dense copy of every
layer avoids that for about 260 MiB more resident memory on the bundled model
(`--quantized-dense-above`). Without the copy, a step of more rows than `Int4Unpacker.above_rows`
unpacks each layer's packed weights into one reused bf16 buffer just before its matmul: the
bundled model's largest matrix (3072 x 576) takes about 0.25 ms on one core, the whole model
about 17 ms a step, against the 70 ms a 256-token chunk loses on the packed kernel.

The unpacking is a small C function (`cpu_kernels.c`, built and loaded by `cpu_kernels.py`); it
reads PyTorch's packed layout, so before any layer uses it, it is checked against the packed kernel
itself on a random matrix. Where the library cannot be had, or the check fails, the packed kernel
runs every step, as before.
`BATCHER_INT4_UNPACK=0` turns it off (to compare) and `BATCHER_INT4_UNPACK_ABOVE=ROWS` sets the
row count from which it is used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from batcher.runtime import cpu_kernels

log = logging.getLogger("batcher.runtime.int4_unpack")

# Steps of more rows than this unpack; fewer run the packed kernel. The bundled model's 120
# int4 linears, bf16, 2 threads of an AMD EPYC (AVX-512 BF16), packed vs unpacked ms: 24 rows
# 18.1 vs 26.6, 32 rows 23.8 vs 29.2, 48 rows 34.8 vs 35.4, 64 rows 45.8 vs 37.7, 128 rows 90.7
# vs 53.0, 256 rows 197.6 vs 127.1 (unpacking about 17 ms a step in all, the packed kernel 0.7
# ms a row). A CPU with matrix units (AMX) speeds the dense matmul, not the packed kernel, so its
# crossover may lie lower: `BATCHER_INT4_UNPACK_ABOVE=ROWS` sets another. (Measuring it at
# start-up was tried: a noisy 0.3 s measurement picked 40-100 rows, and servers that had
# measured ran chat64 slower than with the row count fixed, for reasons not found.)
UNPACK_ABOVE_ROWS = 48
BLOCK_N = 64  # output rows per block of the packed layout the C code reads


class Int4Unpacker:
    """`dense_t(qweight, scales, k, n, group)` -> the layer's weight transposed, [k, n] bf16, in
    a buffer reused by every layer on the calling thread (valid until that thread's next call).
    Layers use it for steps of more than `above_rows` rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fixed = os.environ.get("BATCHER_INT4_UNPACK_ABOVE", "")
        self.above_rows = int(fixed) if fixed.isdigit() else UNPACK_ABOVE_ROWS
        self._fn = lib.int4pack_to_bf16
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._local = threading.local()

    def fits(self, k: int, n: int, group: int, scales: torch.Tensor) -> bool:
        return (n % BLOCK_N == 0 and k % group == 0 and scales.dtype == torch.bfloat16
                and scales.device.type == "cpu" and scales.is_contiguous())

    def dense_t(self, qweight: torch.Tensor, scales: torch.Tensor, k: int, n: int,
                group: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < k * n:
            buf = self._local.buf = torch.empty(k * n, dtype=torch.bfloat16)
        out = buf[:k * n].view(k, n)
        if self._fn(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, group):
            raise ValueError(f"int4 unpack cannot take a {n} x {k} weight in groups of {group}")
        return out


def load(build_dir: Path, group: int) -> Int4Unpacker | None:
    """The unpacker, built into `build_dir` if not there yet, or None (logged) where it cannot
    be built or does not reproduce the packed kernel."""
    if os.environ.get("BATCHER_INT4_UNPACK", "1") == "0":
        log.info("int4 unpacking off (BATCHER_INT4_UNPACK=0): the packed kernel runs every step")
        return None
    try:
        unpacker = Int4Unpacker(cpu_kernels.library(build_dir))
        _check(unpacker, group)
    except (OSError, subprocess.SubprocessError, ValueError, RuntimeError) as exc:
        log.warning("int4 unpacking unavailable (%s): every step runs the packed kernel", exc)
        return None
    return unpacker


def _check(unpacker: Int4Unpacker, group: int) -> None:
    """The unpacked weight equals what the packed kernel multiplies by: x = I gives it back."""
    gen = torch.Generator().manual_seed(0)
    n, k = 2 * BLOCK_N, 2 * group
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group, n, 2, generator=gen) - 0.5).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16),
                                                       packed, group, scales)
    got = unpacker.dense_t(packed, scales, k, n, group)
    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3):
        raise RuntimeError("the packed layout of torch "
                           f"{torch.__version__} on this CPU is not the one the C function reads")
