"""How many kernels and graphs the process has compiled so far: Triton JIT variants of the
project's kernels and torch.compile graphs. A warm server compiles nothing while it serves; the
warm start (`batcher.engine.warmup`) and its tests compare this count before and after traffic."""

from __future__ import annotations

import sys


def _triton_variants() -> int:
    """Compiled variants of the Triton kernels loaded so far (0 where Triton is not in use)."""
    mod = sys.modules.get("batcher.runtime.triton_attention")
    if mod is None or "triton" not in sys.modules:
        return 0
    n = 0
    for value in vars(mod).values():
        caches = getattr(value, "device_caches", None)  # triton.runtime.jit.JITFunction
        if isinstance(caches, dict):
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                n += len(cache) if hasattr(cache, "__len__") else 0
        elif isinstance(getattr(value, "cache", None), dict):
            n += sum(len(c) for c in value.cache.values() if hasattr(c, "__len__"))
    return n


def _dynamo_graphs() -> int:
    """Frames torch.compile has turned into graphs (0 where it was never used)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def compilations() -> int:
    return _triton_variants() + _dynamo_graphs()
