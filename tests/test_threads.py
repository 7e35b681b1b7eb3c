"""torch threads from the container's CPU quota (cgroup v2 `cpu.max`, v1 `cfs_quota_us`), not
from the node's cores."""

from __future__ import annotations

import os
from pathlib import Path

from batcher.system.threads import cpu_quota_threads, quota_cpus

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


# In a child process, so that no other test's threads are counted: a worker thread runs parallel
# torch work (which starts its OpenMP pool), then `snippet`; prints the process's thread count
# while the pool is up and after `snippet`.
_POOL_CHILD = """
import os, sys, threading, time
import torch
from batcher.system import threads
torch.set_num_threads(2)
counts = []
def tasks():
    return len(os.listdir("/proc/self/task"))
def work():
    (torch.ones(1 << 22) * 2).sum()  # large enough for a parallel region
    counts.append(tasks())
    {snippet}
    for _ in range(100):  # the workers may take a moment to exit
        if tasks() < counts[0]:
            break
        time.sleep(0.01)
    counts.append(tasks())
if not threads._gnu_openmp(rescan=True) or len(os.sched_getaffinity(0)) < 2:
    print("skip")
    sys.exit()
t = threading.Thread(target=work)
t.start()
t.join()
print(*counts)
"""


def _pool_counts(snippet: str) -> tuple[int, int]:
    import subprocess
    import sys
    import textwrap

    code = _POOL_CHILD.replace("{snippet}", textwrap.indent(snippet, "    ").strip())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    if out == ["skip"]:
        import pytest

        pytest.skip("needs GNU OpenMP and 2 CPUs")
    return int(out[0]), int(out[1])


def test_release_openmp_pool_lets_the_threads_workers_go() -> None:
    # One pool per thread that ran parallel work, kept for the thread's life: more pools than
    # CPUs make every pool's workers sleep between the step's parallel regions.
    up, after = _pool_counts("assert threads.release_openmp_pool()")
    assert after < up


def test_loading_a_model_and_building_its_runner_leave_no_pool_on_the_thread() -> None:
    # The engine loads on one thread and steps on another: the loader's pool must not stay.
    up, after = _pool_counts(
        "from batcher.models.loader import load_model\n"
        "from batcher.runtime.model_runner import ModelRunner\n"
        "ModelRunner(load_model('tiny', dtype='float32', device='cpu'), 64, 16)")
    assert after < up
