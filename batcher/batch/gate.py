"""Spare capacity: may another batch line start now without delaying interactive traffic?

Admission's TTFT prediction decides. A batch line that starts now is prefilled before any
interactive request arriving after it (running requests are served first, whatever their
priority), so the question is: would an interactive request arriving right after this line still
be predicted within a share of the TTFT SLO (scaled down as far as admission has cut the share
it admits interactive requests within)? Besides that prediction, lines never start while an
interactive request is queued, never take the last sequence slots or KV blocks (interactive
requests must find room without preempting), and at most `max_running` run at once.

Where the model computes on the host's own cores (a CPU), lines beside interactive traffic are
also held to `max_running_beside` in flight and `starts_per_s_beside` starts a second while
interactive requests run or ran within the last `RECENT_S`: each line costs the host as much as
an interactive request (its start, its steps, its stored answer), and there the host is the
device, so a batch of short lines at full width slowed an interactive stream beside it 4-12x. On
a GPU the host has cores to spare and the TTFT prediction alone decides.

Without a TTFT SLO the prediction has nothing to compare with; the structural checks still hold.
One line may always start on an idle engine (nothing running or queued): that keeps the batch
moving when the prediction is stale or not yet measured, at the cost of one line's prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from batcher.admission.admission import Admission
from batcher.core.backlog import Backlog
from batcher.engine.engine import AsyncEngine
from batcher.core.request import Priority
from batcher.admission.slo_limit import CEILING


@dataclass(slots=True)
class GateConfig:
    """`max_running`: batch lines in flight at once. `ttft_share`: an interactive request
    arriving after a new line must be predicted within this share of the TTFT SLO.
    `shed_share`: running lines are shed (cancelled, run again later) while an interactive
    request arriving now is predicted past this share of the SLO; above `ttft_share`, so starting
    and shedding do not chase each other. `free_blocks_share`: KV blocks kept free for interactive
    requests. `probe_tokens`: the prompt
    of the interactive request assumed to arrive next. `max_running_beside`,
    `starts_per_s_beside`: batch lines in flight at once, and started a second, while
    interactive requests run (or ran within `RECENT_S`); None takes the device's
    (`beside_limits`)."""

    max_running: int = 16
    max_running_beside: int | None = None  # None: by the device (see the module docstring)
    starts_per_s_beside: float | None = None
    ttft_share: float = 0.5
    shed_share: float = 0.8
    free_blocks_share: float = 0.25
    probe_tokens: int = 128

    def validate(self) -> GateConfig:
        if self.max_running < 1:
            raise ValueError(f"batch max running must be >= 1, got {self.max_running}")
        if self.max_running_beside is not None and not 1 <= self.max_running_beside:
            raise ValueError(f"batch lines beside interactive traffic must be >= 1, got "
                             f"{self.max_running_beside}")
        if self.starts_per_s_beside is not None and not self.starts_per_s_beside > 0:
            raise ValueError(f"batch starts a second beside interactive traffic must be > 0, "
                             f"got {self.starts_per_s_beside}")
        if not 0 < self.ttft_share <= 1:
            raise ValueError(f"batch TTFT share must be in (0, 1], got {self.ttft_share}")
        if not self.ttft_share <= self.shed_share <= 1:
            raise ValueError(f"batch shed share must be in [{self.ttft_share}, 1], got "
                             f"{self.shed_share}")
        if not 0 <= self.free_blocks_share < 1:
            raise ValueError(f"batch free-block share must be in [0, 1), got "
                             f"{self.free_blocks_share}")
        return self


# Interactive traffic seen this recently still counts as present: a closed-loop client is gone
# only between its requests, and lines started in that gap would run beside its next one.
RECENT_S = 1.0
# Beside interactive traffic where the model runs on the host's cores: lines in flight, starts a
# second (measured with `python -m scripts.bench attacks`: the other tenant's p99 within 2x).
CPU_RUNNING_BESIDE = 1
CPU_STARTS_PER_S_BESIDE = 20.0


def beside_limits(cfg: GateConfig, on_cpu: bool) -> tuple[int, float]:
    """(lines in flight, starts a second) beside interactive traffic: the configured ones, else
    the device's: held on a CPU, none past `max_running` elsewhere."""
    running = cfg.max_running_beside
    if running is None:
        running = CPU_RUNNING_BESIDE if on_cpu else cfg.max_running
    starts = cfg.starts_per_s_beside
    if starts is None:
        starts = CPU_STARTS_PER_S_BESIDE if on_cpu else float("inf")
    return min(running, cfg.max_running), starts


class SpareCapacity:
    """Reads the engine's queues and admission's prediction; changes nothing of theirs."""

    def __init__(self, engine: AsyncEngine, admission: Admission, cfg: GateConfig,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.admission = admission
        self.cfg = cfg.validate()
        self.clock = clock
        device = getattr(getattr(engine, "runner", None), "device", None)
        self.running_beside, self.starts_per_s_beside = beside_limits(
            cfg, getattr(device, "type", None) == "cpu")
        self._interactive_at = float("-inf")  # when interactive requests were last seen
        self._started_at = float("-inf")  # when a line was last let start
        self.last_reason = "idle"
        self.last_code = "idle"  # the same, as a short metric label
        # The interactive TTFT the last check predicted for an arrival right after a new line
        # (None: that check did not get as far as the prediction).
        self.last_predicted_s: float | None = None

    def interactive_waiting(self) -> bool:
        """An interactive request is queued, or running with its prompt not yet computed:
        batch lines should give way. Running requests are served first, whatever their
        priority, so a line's prompt is computed before the interactive one; and a line that
        decodes is a stream whose time per token the scheduler protects by cutting prefill
        chunks, the interactive prompt's included."""
        sched = self.engine.scheduler
        return (any(r.priority <= Priority.INTERACTIVE for r in sched.waiting)
                or any(r.priority <= Priority.INTERACTIVE and r.num_tokens - r.num_computed_tokens > 1
                       for r in sched.running))

    def interactive_recent(self) -> bool:
        """Interactive requests are in the engine now, or were within `RECENT_S`."""
        now = self.clock()
        sched = self.engine.scheduler
        # NOTE: the interactive class only: an operator's deep probe (one token, ahead of
        # everyone) is not traffic a line would slow.
        if any(r.priority == Priority.INTERACTIVE for q in (sched.running, sched.waiting)
               for r in q):
            self._interactive_at = now
            return True
        return now - self._interactive_at < RECENT_S

    def _slo_scale(self) -> float:
        """How far admission has cut the share of the SLO it admits interactive requests within
        (1 at its ceiling): the gate's shares shrink with it, so batch starts less and is shed
        before interactive requests are refused."""
        return min(1.0, self.admission.limit.share / CEILING)

    def shed(self) -> bool:
        """Interactive traffic is predicted to miss its SLO with the work running now (the
        machine slowed, or interactive load rose): batch work should give way."""
        slo = self.admission.slo_ttft_s
        if slo is None:
            return False
        slo *= self._slo_scale()
        predicted = self.admission.predictor.predict(
            self.admission.clock(), Backlog.of_scheduler(self.engine.scheduler), "interactive",
            self.cfg.probe_tokens)
        return predicted is not None and predicted > self.cfg.shed_share * slo

    def room(self, in_flight: int, prompt_tokens: int, max_tokens: int, lines: int = 1
             ) -> bool:
        """True when `lines` lines (this one and those started since the engine last saw them,
        `prompt_tokens` and up to `max_tokens` out in all) may start now, `in_flight` being
        running already; `last_reason` says why not."""
        self.last_predicted_s = None
        why = self._blocker(in_flight, prompt_tokens, max_tokens, lines)
        self.last_code, self.last_reason = why or ("room", "room")
        if why is None:
            self._started_at = self.clock()
        return why is None

    def _blocker(self, in_flight: int, prompt_tokens: int, max_tokens: int, lines: int
                 ) -> tuple[str, str] | None:
        """(metric label, explanation) of what keeps the line from starting, or None."""
        eng = self.engine
        if not eng.healthy or self.admission.draining:
            return "not_serving", "engine not serving"
        if in_flight >= self.cfg.max_running:
            return "cap", "batch lines at their cap"
        sched = eng.scheduler
        if self.interactive_waiting():
            return "interactive_queued", "interactive requests are queued or prefilling"
        if self.interactive_recent() and (
                in_flight >= self.running_beside
                or self.clock() - self._started_at < 1.0 / self.starts_per_s_beside):
            return "beside", "batch lines at their cap beside interactive requests"
        max_seqs = sched.config.max_num_seqs
        # Slots and blocks a new interactive request needs must stay free.
        if sched.num_running + sched.num_waiting + lines > max_seqs - max(1, max_seqs // 8):
            return "slots", "sequence slots reserved for interactive traffic"
        # NOTE: one line may always start on an idle engine. The prediction learns only from
        # steps that run: were it to stay pessimistic (measured while lines crowded the engine,
        # or not measured yet) an idle engine would never run the step that corrects it. And
        # one line delays an interactive request by at most its own prefill.
        idle = sched.num_running == 0 and sched.num_waiting == 0 and lines == 1
        kv = eng.kv
        need = -(-(prompt_tokens + max_tokens) // kv.block_size)
        # An idle engine lends a line the reserve too: a line bigger than the pool less the
        # reserve (but within the pool: the engine refuses more) would otherwise never start.
        reserve = 0 if idle and in_flight == 0 else self.cfg.free_blocks_share
        if kv.num_free_blocks - need < reserve * kv.num_total_blocks:
            return "kv", "KV blocks reserved for interactive traffic"
        slo = self.admission.slo_ttft_s
        if slo is not None:
            slo *= self._slo_scale()
        if slo is not None and not idle:
            # The interactive work the arrival would find; batch lines are left out, since
            # they give way when it arrives (the executor cancels them within a step). The
            # new lines' prompts count as if still ahead of the arrival's own: at most the
            # step they are in, bounded by them.
            interactive = Backlog.of(
                [r for r in sched.waiting if r.priority <= Priority.INTERACTIVE],
                [r for r in sched.running if r.priority <= Priority.INTERACTIVE],
                sched.config.max_num_seqs)
            predicted = self.admission.predictor.predict(
                self.admission.clock(), interactive, "interactive",
                prompt_tokens + self.cfg.probe_tokens)
            self.last_predicted_s = predicted
            if predicted is None:
                return "no_prediction", "no prediction yet (one line at a time until measured)"
            if predicted > self.cfg.ttft_share * slo:
                return "ttft", "interactive TTFT would exceed its share of the SLO"
        return None
