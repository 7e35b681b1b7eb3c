"""The paged KV cache tensors: per layer K and V of shape [num_blocks, block_size, kv_heads,
head_dim], and how many blocks a memory budget buys."""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np
import torch

# Without a budget on the CPU, take this much (bounded by a quarter of physical memory).
CPU_DEFAULT_KV_BYTES = 2 * 2**30
_ALIGN = 64  # bytes


class KVShape(Protocol):
    """What the cache needs of a model's config (a `LlamaConfig` fits). The runtime states it
    here rather than importing the model package, which sits above it."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def allocate_kv_cache(cfg: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cpu":
        return [(lazy_zeros(shape, dtype), lazy_zeros(shape, dtype))
                for _ in range(cfg.num_layers)]
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose memory becomes resident page by page as it is first written.
    numpy's zeros come from calloc, which maps fresh zero pages for a large block instead of
    writing them (torch.zeros writes every byte). So the KV pool costs resident memory for the
    blocks in use, not for the budget: the default budget is far more than one conversation
    needs. The cost moves to first writes, a page fault per 4 KiB of new K/V (measured
    in BENCHMARKS.md, "Resident memory")."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = size * math.prod(shape)
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN  # the kernels' vector loads like 64-byte alignment
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


def default_kv_budget(device: torch.device, gpu_memory_utilization: float = 0.9) -> int:
    """Bytes for the KV cache when the user gave none.

    CUDA: the usual convention — `gpu_memory_utilization` of the device minus what is already in
    use (weights, activations). CPU: a fixed budget, at most a quarter of physical memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used)
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        phys = 8 * 2**30
    return min(CPU_DEFAULT_KV_BYTES, phys // 4)
