"""A warm start on a simulated replica: the calibration plan `batcher serve` runs before it reports
ready (`batcher.core.calibration`), driven through the replica's real scheduler on the simulated
clock, so its steps feed the replica's step-time model and admission as the engine's do."""

from __future__ import annotations

import itertools

from batcher.core.calibration import Plan, synthetic_prompt
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.engine_sim import SimReplica, Timing

# The simulated replica keeps no tokenizer: prompts draw from this many ids.
_VOCAB = 31_000


def run_plan(replica: SimReplica, plan: Plan, now: float = 0.0) -> float:
    """Run every wave of `plan` on an idle `replica` from `now`; returns the time it ended. The
    requests bypass admission (the engine's warm start does too)."""
    ids = itertools.count()
    names = itertools.count()

    def add(prompt: int, max_tokens: int, at: float) -> str:
        rid = f"warm-{next(names)}"
        req = Request(rid, synthetic_prompt(ids, prompt, _VOCAB),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        replica.add(req, Timing(rid, at, prompt, max_tokens), at)
        return rid

    replica.step_time_model.start_recording()
    refit = True
    for wave in plan.waves:
        if refit and wave.late:  # as the engine's warm start does (`batcher.engine.warmup`)
            replica.step_time_model.refit_recorded(keep=True)
            refit = False
        first = [add(g.prompt_tokens, g.max_tokens, now) for g in wave.first
                 for _ in range(g.count)]
        late_added = not wave.late
        started: set[str] = set()
        prev = replica.on_token

        def seen(t: Timing, at: float) -> None:
            started.add(t.request_id)

        replica.on_token = seen
        try:
            while replica.scheduler.has_unfinished() or not late_added:
                if not late_added and all(r in started for r in first):
                    for g in wave.late:
                        for _ in range(g.count):
                            add(g.prompt_tokens, g.max_tokens, now)
                    late_added = True
                end = replica.start_step(now)
                if end is None:
                    break
                now = end
                replica.finish_step(now)
        finally:
            replica.on_token = prev
    replica.step_time_model.refit_recorded()
    return now
