"""How many CPUs this process may use: the cgroup CPU quota of its container, not the cores of
the node it runs on. torch starts one intra-op thread per core it sees; in a pod limited to 4
CPUs on a 64-core node that is 64 threads taking turns on 4 CPUs' worth of time, and every step
pays for it in throttling. And how many OpenMP thread pools it keeps: one per thread that ran
parallel work, where only the model's stepping thread should keep one."""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU limit in CPUs (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), None when
    unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cpu_quota_threads(root: Path = CGROUP_ROOT) -> int | None:
    """Threads for torch: the quota rounded up, at most the CPUs this process may run on;
    None when there is no quota (torch's own default is then right)."""
    quota = quota_cpus(root)
    if quota is None or quota <= 0:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(math.ceil(quota), usable or 1))


# omp_pause_resource_all's "soft" kind: the runtime lets its threads go and starts new ones on
# the next parallel region.
_OMP_PAUSE_SOFT = 1


_loaded: dict[str, ctypes.CDLL | None] = {}  # path -> the runtime, None: not one we can pause


def _gnu_openmp(rescan: bool) -> tuple[ctypes.CDLL, ...]:
    """The GNU OpenMP runtimes this process has loaded (torch's CPU builds ship one; the kernels
    torch.compile builds, or another library, may bring the system's): looked for in the
    process's mappings when `rescan` or never yet (a scan costs about half a millisecond)."""
    for path in _libgomp_paths() if rescan or not _loaded else ():
        if path not in _loaded:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                lib = None
            if lib is not None and not hasattr(lib, "omp_pause_resource_all"):
                lib = None  # too old to pause
            _loaded[path] = lib
    return tuple(lib for lib in _loaded.values() if lib is not None)


def _libgomp_paths() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {parts[5].strip() for line in f if "libgomp" in line
                    and len(parts := line.split(maxsplit=5)) == 6}
    except OSError:  # no /proc (macOS): torch there uses its own runtime
        return set()


def release_openmp_pool(rescan: bool = True) -> bool:
    """Let the calling thread's OpenMP worker threads go; whether a GNU OpenMP runtime took the
    request.

    GNU OpenMP keeps a pool of worker threads for every thread that has run a parallel region,
    for the life of that thread. While the process holds more of them than it may use CPUs, every
    pool's workers wait between parallel regions by a futex instead of a short spin, and a
    decode step runs hundreds of small regions: on 2 CPUs, a batch-1 step of the bundled int4
    model took 30-45 ms on the engine's model thread once the loading thread's pool existed,
    16-18 ms without it. A thread that loaded weights or built tensors for another thread to
    run calls this when it is done. The next parallel region on this thread starts a new pool.
    `rescan=False` (a frequent caller): only the runtimes found by an earlier call."""
    codes = [lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) for lib in _gnu_openmp(rescan)]
    return bool(codes) and not any(codes)
