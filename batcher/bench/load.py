"""How busy the machine was: a benchmark on a shared host is only as good as its quiet.

The server under test and the bench client share the CPUs with whatever else runs. `CpuMeter`
splits the CPU time used during a run into the server's, the client's and everyone else's (the
background), from /proc (Linux), so a row measured on a contended machine says so. `wait_quiet`
holds a run back until the machine has been idle for a few seconds.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy() -> int | None:
    """Busy clock ticks of all CPUs since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    # guest time is already counted in user and nice
    return user + nice + system + irq + softirq + steal


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces: split after its closing parenthesis.
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used itself (None when it cannot be read: gone,
    or no /proc)."""
    rest = _stat(pid)
    return None if rest is None else (int(rest[11]) + int(rest[12])) / HZ


def _process_busy(pid: int) -> int:
    """User + system clock ticks of a process and its reaped children (0 when it is gone)."""
    rest = _stat(pid)
    return 0 if rest is None else sum(int(x) for x in rest[11:15])


def _tree_busy(pid: int) -> int:
    """Ticks of a process and all its live descendants: a server started through a shell or a
    launcher is a child of the pid the caller knows."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (rest := _stat(entry)) is not None:
            parents[int(entry)] = int(rest[1])
    total = 0
    for p in parents:
        q: int | None = p
        while q is not None and q != pid:
            q = parents.get(q)
        if q == pid:
            total += _process_busy(p)
    return total


@dataclass(slots=True)
class CpuUse:
    """Mean CPU cores busy during a window, split by who used them."""

    seconds: float
    machine: float
    server: float | None
    client: float
    background: float

    def describe(self) -> str:
        server = "" if self.server is None else f", server {self.server:.2f}"
        return (f"CPU cores busy: machine {self.machine:.2f}{server}, bench client "
                f"{self.client:.2f}, background {self.background:.2f} over {self.seconds:.0f} s")


class CpuMeter:
    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid
        self._start: tuple[float, int, int, int] | None = None

    def _read(self) -> tuple[float, int, int, int] | None:
        machine = _machine_busy()
        if machine is None:
            return None
        server = _tree_busy(self.server_pid) if self.server_pid else 0
        return time.monotonic(), machine, server, _process_busy(os.getpid())

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> CpuUse | None:
        end = self._read()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        dt = end[0] - self._start[0]
        machine, server, client = ((e - s) / HZ / dt for s, e in zip(self._start[1:], end[1:]))
        background = max(0.0, machine - server - client)
        return CpuUse(dt, machine, server if self.server_pid else None, client, background)


async def wait_quiet(max_wait: float, threshold: float = 0.25, quiet_for: float = 3.0
                     ) -> float | None:
    """Wait until the machine used under `threshold` cores for `quiet_for` seconds in a row, or
    `max_wait` seconds passed; returns the seconds waited (None: never quiet, or not Linux)."""
    t0 = last_t = time.monotonic()
    quiet = 0.0
    last = _machine_busy()
    if last is None:
        return None
    while last_t - t0 < max_wait:
        await asyncio.sleep(0.5)
        now, now_t = _machine_busy() or 0, time.monotonic()
        cores = (now - last) / HZ / (now_t - last_t)
        quiet = quiet + (now_t - last_t) if cores < threshold else 0.0
        last, last_t = now, now_t
        if quiet >= quiet_for:
            return time.monotonic() - t0
    return None
