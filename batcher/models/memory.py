"""Whether a model fits its device, checked from its config before any weight is allocated: a
load that cannot fit then fails at once with one line that says by how much, instead of after
seconds of allocation with an out-of-memory trace (or, on a CPU, in swap)."""

from __future__ import annotations

from pathlib import Path

import torch

from batcher.models.errors import ModelLoadError
from batcher.models.llama import LlamaConfig

# KV cache the check keeps room for beyond the weights: one 4k-token sequence. The cache is sized
# from what is left after the weights (`batcher.runtime.kv_cache`); with less than this a server
# would start and then refuse every long prompt.
MIN_KV_TOKENS = 4096
MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
GB = 1e9


def weight_bytes(cfg: LlamaConfig, dtype: torch.dtype) -> int:
    return cfg.num_parameters() * dtype.itemsize


def host_available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP_ROOT) -> int | None:
    """Memory the host can give this process without swapping: MemAvailable, or less where the
    container's cgroup v2 limit leaves less. None when neither can be read."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((cgroup / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def free_bytes(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for new tensors on `device` or None when unknown, the device's name)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.mem_get_info(index)[0], f"cuda:{index}"
    if device.type == "cpu":
        return host_available_bytes(), "the host"
    return None, str(device)


def check_fits(name: str, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ModelLoadError unless `cfg`'s weights in `dtype` and a minimal KV cache
    (`MIN_KV_TOKENS`) fit the memory `device` has free now. Reads the config only."""
    free, where = free_bytes(device)
    if free is None:
        return
    weights = weight_bytes(cfg, dtype)
    kv = MIN_KV_TOKENS * cfg.kv_bytes_per_token(dtype)
    if weights + kv <= free:
        return
    kind = str(dtype).removeprefix("torch.")
    raise ModelLoadError(
        f"{name} needs {weights / GB:.1f} GB for {kind} weights and {kv / GB:.1f} GB for a "
        f"minimal KV cache but {where} has {free / GB:.1f} GB "
        f"{'free' if device.type == 'cuda' else 'available'}")
