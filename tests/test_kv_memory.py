"""The CPU KV pool is zeros that cost resident memory only for the pages written."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from batcher.runtime.kv_cache import allocate_kv_cache, lazy_zeros


@dataclass
class _Shape:
    num_layers: int = 2
    num_kv_heads: int = 3
    head_dim: int = 64


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_cpu_kv_pool_is_zeros_in_the_asked_layout() -> None:
    caches = allocate_kv_cache(_Shape(), 10, 16, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 2
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (10, 16, 3, 64) and t.dtype == torch.bfloat16
            assert t.is_contiguous() and t.data_ptr() % 64 == 0
            assert not t.any()
        assert k.data_ptr() != v.data_ptr()
    k[3, 5] = 1.5  # writable, and a write lands where it is asked to
    assert k.sum().item() == 1.5 * 3 * 64 and k[3, 5].eq(1.5).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_kv_pool_is_resident_only_where_written() -> None:
    before = _rss_mib()
    pool = lazy_zeros((1024, 16, 4, 1024), torch.float32)  # 256 MiB
    allocated = _rss_mib()
    pool[:64] = 1.0  # 16 MiB of blocks written
    written = _rss_mib()
    assert allocated - before < 32, (before, allocated)
    assert 12 < written - allocated < 48, (allocated, written)
    assert pool[64:].abs().max().item() == 0.0
