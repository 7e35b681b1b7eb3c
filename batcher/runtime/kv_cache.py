"""The paged KV cache tensors: per layer K and V of shape [num_blocks, block_size, kv_heads,
head_dim], and how many blocks a memory budget buys."""

from __future__ import annotations

import os
from typing import Protocol

import torch

# Without a budget on the CPU, take this much (bounded by a quarter of physical memory).
CPU_DEFAULT_KV_BYTES = 2 * 2**30


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
    # zeros, not empty: pages are touched now rather than faulted in during the first steps.
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]


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
