"""A TPOT SLO below what the running streams' own decode step costs: no chunk size meets it, so
the scheduler does the least harm it can, one minimum chunk a step (the oldest prompt still
moves, nothing else does), on a simulated clock."""

from __future__ import annotations

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.prefill_pacing import LONG_CATCH_UP, LONG_READ_PACE
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
    arrival, start = len(sim.steps), sim.now
    sim.run_until(lambda: bool(sim.token_times["a"]))
    steps = sim.steps[arrival:]
    chunks = [prefill_of(out, "a") for out, _, _ in steps]
    assert all(prefill_of(out, "b") == 0 for out, _, _ in steps)  # one chunk a step
    assert all(target == 0.02 for _, _, target in steps)
    if slo_ttft_s is None:
        # 600 tokens at 3 a step.
        assert chunks == [3] * 200
        return
    # Under a 50 ms TTFT SLO the prompt is late at any chunk size: it is not paced to the SLO
    # (a prompt that can still meet it is, streams over their TPOT SLO or not:
    # tests/test_step_budget.py), but read evenly so that its first token comes within about
    # LONG_READ_PACE times its whole-budget reading, not after 200 steps of the minimum chunk.
    whole = Sim(SchedulerConfig(64, 320, 4096, prefill_budget="fixed", burst_window_s=0.0))
    for i in range(8):
        whole.add(f"s{i}", 100, 400)
    whole.run_until(lambda: all(len(whole.token_times[f"s{i}"]) >= 20 for i in range(8)))
    whole.add("a", 600, 2)
    whole_start = whole.now
    whole.run_until(lambda: bool(whole.token_times["a"]))
    whole_s = whole.now - whole_start  # beside the same streams, at the whole budget
    assert len(chunks) < 200 / 3
    assert sim.now - start <= 1.1 * LONG_READ_PACE * whole_s, (sim.now - start, whole_s)
    # Even chunks; catching up at the end takes at most LONG_CATCH_UP times one.
    assert max(chunks) <= LONG_CATCH_UP * 1.2 * min(chunks[:-1]), chunks
