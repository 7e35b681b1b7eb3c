"""How many intra-op threads a CPU step of a given size runs with, chosen by measuring.

A decode step of a few rows is memory-bound: splitting its small matmuls over every core buys
little, and on a machine with few cores the team's barrier waits on whichever core the server's
event loop (detokenizing, writing streams) just took. A big step (many rows, a prefill chunk) is
compute-bound and runs on every core, however few its rows: a step that reads a prompt chunk
beside decode rows is not measured with them (in one group, a tuner that picked one thread for
8 decode rows ran their steps with a 4-token chunk on it too: 75 against 56 ms on two threads,
and the chunk's own share 2x slower). Below `TUNED_BELOW_ROWS` rows the best count for decode
rows (and rows verifying drafts) depends on the CPU, the model and the load, so it is measured:
steps are grouped by row count (powers of two), and each group tries its candidate thread counts
in turn, a few steps each, interleaved so drift hits all alike, then keeps the one with the
lowest median time per row. A group measures again every `recheck_every` of its steps. Never
more threads than the process was given (`--torch-threads`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("batcher.runtime.threads")

MAX_GROUP = 10  # steps of 1024 rows and more are one group
# Steps of this many rows and more always run on every thread: they are compute-bound (32 rows:
# 4.1 ms a row on two threads against 4.8 on one; a prefill chunk 1.4 against 1.9), and trying
# fewer threads on them would slow the prefills that the TTFT predictor learns its rates from.
TUNED_BELOW_ROWS = 16


def candidates(full: int) -> tuple[int, ...]:
    """Thread counts worth trying under a budget of `full`: all of them, one fewer (a core left
    to the event loop) and half."""
    return tuple(sorted({full, max(1, full - 1), max(1, full // 2)}, reverse=True))


def group_of(rows: int) -> int:
    return min(max(rows, 1).bit_length() - 1, MAX_GROUP)


@dataclass(slots=True)
class _Group:
    chosen: int | None = None
    turn: int = 0
    since: int = 0  # steps since the choice
    samples: dict[int, list[float]] = field(default_factory=dict)


class ThreadTuner:
    """`threads(rows, reads_prompt)` before a step, `record(rows, threads, seconds,
    reads_prompt)` after it. Not thread-safe: the model thread owns it."""

    def __init__(self, full: int, samples: int = 8, recheck_every: int = 4096,
                 on_choice: Callable[[int, int, dict[int, float]], None] | None = None) -> None:
        self.options = candidates(full)
        self.samples, self.recheck_every = samples, recheck_every
        self.on_choice = on_choice or _log_choice
        self._groups: dict[int, _Group] = {}

    def threads(self, rows: int, reads_prompt: bool = False) -> int:
        """The count a step of `rows` rows runs with; `reads_prompt`: it carries a prompt
        chunk (every thread, never a sample)."""
        if rows >= TUNED_BELOW_ROWS or reads_prompt:
            return self.options[0]
        g = self._groups.setdefault(group_of(rows), _Group())
        if g.chosen is not None and g.since < self.recheck_every:
            return g.chosen
        return self.options[g.turn % len(self.options)]

    def record(self, rows: int, threads: int, seconds: float, reads_prompt: bool = False) -> None:
        if rows >= TUNED_BELOW_ROWS or reads_prompt:
            return
        gid = group_of(rows)
        g = self._groups.setdefault(gid, _Group())
        if g.chosen is not None and g.since < self.recheck_every:
            g.since += 1
            return
        if threads != self.options[g.turn % len(self.options)]:
            return  # not this group's turn (the group was created mid-step): not a sample
        g.turn += 1
        g.samples.setdefault(threads, []).append(seconds / max(rows, 1))
        if all(len(g.samples.get(n, ())) >= self.samples for n in self.options):
            medians = {n: statistics.median(g.samples[n]) for n in self.options}
            g.chosen = min(self.options, key=lambda n: (medians[n], -n))
            g.since, g.samples, g.turn = 0, {}, 0
            self.on_choice(gid, g.chosen, medians)

    def chosen(self) -> dict[int, int]:
        """Rows (the smallest of each measured group) -> the thread count it runs with."""
        return {1 << gid: g.chosen for gid, g in sorted(self._groups.items())
                if g.chosen is not None}


def _log_choice(group: int, threads: int, medians: dict[int, float]) -> None:
    times = ", ".join(f"{n} {'thread' if n == 1 else 'threads'} {sec * 1000:.2f} ms"
                      for n, sec in medians.items())
    log.info("steps of %d+ rows run on %d intra-op %s (time per row: %s)", 1 << group, threads,
             "thread" if threads == 1 else "threads", times)
