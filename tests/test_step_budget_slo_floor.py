"""A TPOT SLO below what the running streams' own decode step costs: no chunk size meets it, so
the scheduler does the least harm it can, one minimum chunk a step (the oldest prompt still
moves, nothing else does), on a simulated clock."""

from __future__ import annotations

import pytest

from batcher.config import SchedulerConfig
from tests.test_step_budget import Sim, prefill_of


@pytest.mark.parametrize("slo_ttft_s", [None, 0.05])
def test_decode_step_over_the_slo_gets_the_minimum_chunk_only(slo_ttft_s: float | None) -> None:
    # burst fill off: the prompts arrive under a second after the streams started, which would
    # make them one burst with the streams on this simulated clock
    sim = Sim(SchedulerConfig(64, 320, 4096, slo_tpot_s=0.02, slo_ttft_s=slo_ttft_s,
                              min_prefill_chunk=3, burst_window_s=0.0))
    for i in range(8):
        sim.add(f"s{i}", 100, 400)
    sim.run_until(lambda: all(len(sim.token_times[f"s{i}"]) >= 20 for i in range(8)))
    assert sim.steady(8, 120) > 0.02  # the streams alone are over the SLO
    sim.add("a", 600, 2)
    sim.now += 0.01
    sim.add("b", 600, 2)
    arrival = len(sim.steps)
    sim.run_until(lambda: bool(sim.token_times["a"]))
    steps = sim.steps[arrival:]
    # 600 tokens at 3 a step. Under a 50 ms TTFT SLO the prompt is late at any chunk size, so the
    # first-token pacing leaves the streams their (unreachable) target too; a prompt that can
    # still meet its TTFT SLO is paced to it (tests/test_step_budget.py), streams over their
    # TPOT SLO or not.
    assert [prefill_of(out, "a") for out, _, _ in steps] == [3] * 200
    assert all(prefill_of(out, "b") == 0 for out, _, _ in steps)  # one chunk a step
    assert all(target == 0.02 for _, _, target in steps)
