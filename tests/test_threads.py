"""torch threads from the container's CPU quota (cgroup v2 `cpu.max`, v1 `cfs_quota_us`), not
from the node's cores."""

from __future__ import annotations

import os
from pathlib import Path

from batcher.threads import cpu_quota_threads, quota_cpus

USABLE = len(os.sched_getaffinity(0))


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert quota_cpus(tmp_path) == 1.5
    assert cpu_quota_threads(tmp_path) == min(2, USABLE)  # rounded up, capped by affinity


def test_unlimited_or_unknown_is_none(tmp_path: Path) -> None:
    assert cpu_quota_threads(tmp_path) is None  # no cgroup files at all
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert quota_cpus(tmp_path) is None
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert quota_cpus(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cpus(tmp_path) == 0.5
    assert cpu_quota_threads(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert quota_cpus(tmp_path) is None
