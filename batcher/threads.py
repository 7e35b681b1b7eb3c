"""How many CPUs this process may use: the cgroup CPU quota of its container, not the cores of
the node it runs on. torch starts one intra-op thread per core it sees; in a pod limited to 4
CPUs on a 64-core node that is 64 threads taking turns on 4 CPUs' worth of time, and every step
pays for it in throttling."""

from __future__ import annotations

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
