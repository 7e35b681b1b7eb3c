"""The engine's unserved work as admission sees it: read once per admission decision from the
scheduler's queues (or built by hand in tests), and what the TTFT prediction walks
(`ttft_predictor`). Pure Python."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from batcher.core.config import SchedulerConfig
from batcher.core.request import Priority, Request


class _Sched(Protocol):
    waiting: list[Request]
    running: list[Request]

    @property
    def config(self) -> SchedulerConfig: ...


@dataclass(frozen=True, slots=True)
class Backlog:
    """The engine's unserved work as admission sees it, read once per admission decision.

    `waiting`: requests queued (not yet started); `waiting_interactive` of them interactive (or
    higher). `running`: requests holding a slot; `free_slots`: slots open now. `ahead_*`:
    uncomputed prefill tokens a new request of that priority would wait behind.
    `steps_left`: decode steps each running request has left at most (max_tokens minus its
    output), ascending: when slots free up. `new_steps`: mean max_tokens of the waiting requests
    (how long a slot they take holds it). `max_context`: the longest running sequence (tokens).
    `longest_prompt`: the longest prompt still to be read, queued or in chunks (tokens).
    """

    waiting: int = 0
    waiting_interactive: int = 0
    running: int = 0
    free_slots: int = 1 << 30
    ahead_interactive: int = 0
    ahead_batch: int = 0
    steps_left: tuple[int, ...] = ()
    new_steps: float = 0.0
    max_context: int = 0
    longest_prompt: int = 0

    @classmethod
    def of(cls, waiting: Iterable[Request], running: Iterable[Request],
           max_num_seqs: int = 1 << 30) -> Backlog:
        """From the scheduler's queues (running first, then waiting in queue order)."""
        run_tokens = max_ctx = longest = 0
        steps: list[int] = []
        for r in running:
            left = r.num_tokens - r.num_computed_tokens
            # NOTE: one token left is a decode (the last sampled token is not yet fed back).
            if left > 1:
                run_tokens += left
                longest = max(longest, r.num_tokens)
            steps.append(max(1, r.sampling.max_tokens - r.num_output_tokens))
            max_ctx = max(max_ctx, r.num_tokens)
        high = low = n_wait = n_high = new_steps = 0
        for r in waiting:
            if r.priority < 0:
                continue  # the operator's deep probe: one token, never in tenants' queue bound
            n_wait += 1
            longest = max(longest, r.num_tokens)
            new_steps += max(1, r.sampling.max_tokens - r.num_output_tokens)
            if r.priority <= Priority.INTERACTIVE:
                n_high += 1
                high += r.num_tokens - r.num_computed_tokens
            else:
                low += r.num_tokens - r.num_computed_tokens
        steps.sort()
        mean_new = new_steps / n_wait if n_wait else (sum(steps) / len(steps) if steps else 0.0)
        return cls(waiting=n_wait, waiting_interactive=n_high, running=len(steps),
                   free_slots=max(0, max_num_seqs - len(steps)),
                   ahead_interactive=run_tokens + high, ahead_batch=run_tokens + high + low,
                   steps_left=tuple(steps), new_steps=mean_new, max_context=max_ctx,
                   longest_prompt=longest)

    @classmethod
    def of_scheduler(cls, sched: _Sched) -> Backlog:
        return cls.of(sched.waiting, sched.running, sched.config.max_num_seqs)

    def ahead(self, priority: str) -> int:
        """Prefill tokens ahead of a new request of this priority."""
        return self.ahead_batch if priority == "batch" else self.ahead_interactive

    def queued_ahead(self, priority: str) -> int:
        """Waiting requests ahead of a new request of this priority."""
        return self.waiting if priority == "batch" else self.waiting_interactive

    def decoding_while_waiting(self, priority: str) -> int:
        """Streams decoding while a new request of this priority waits for its prefill: those
        running now, and those queued ahead of it once they start, as far as slots allow."""
        return min(self.running + self.free_slots, self.running + self.queued_ahead(priority))

    def steps_to_slot(self, priority: str) -> float:
        """Decode steps until a slot frees for a new request of this priority: the requests
        queued ahead take the slots that open first, in the order running requests end; past
        one round of those, each further round waits for the newcomers' own generations."""
        need = self.queued_ahead(priority) + 1 - self.free_slots
        if need <= 0 or not self.steps_left:
            return 0.0
        k = need - 1
        n = len(self.steps_left)
        return self.steps_left[k % n] + (k // n) * self.new_steps
