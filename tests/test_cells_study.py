"""The cells studies, short: the real balancer policy against a static tenant split and random
spreading, and headroom against autoscaling over a day."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batcher.sim.cells_study import CellsConfig, DayConfig, run_cells, run_day

BASE = CellsConfig(duration=90.0, warmup=20.0, bad_at=30.0)


def test_a_hot_tenant_stays_its_own_problem_behind_the_balancer():
    home = run_cells(replace(BASE, policy="home", hot_share=0.2))
    bal = run_cells(replace(BASE, policy="balancer", hot_share=0.2))
    # Pinned to its home cell, the hot tenant overloads it and its neighbours there miss the SLO;
    # the balancer moves it out before the queue deepens.
    assert home.others_goodput < 0.95 and bal.others_goodput > 0.99
    assert bal.shed == 0.0 and 0.0 < bal.moved < 0.6


def test_a_bad_deploy_in_one_cell_is_routed_around():
    home = run_cells(replace(BASE, policy="home", bad_cell=0))
    rnd = run_cells(replace(BASE, policy="random", bad_cell=0))
    bal = run_cells(replace(BASE, policy="balancer", bad_cell=0))
    assert bal.goodput > max(home.goodput, rnd.goodput) + 0.05
    assert bal.p99_wait < 1.0 < min(home.p99_wait, rnd.p99_wait)


def test_overload_is_shed_early_rather_than_queued():
    rnd = run_cells(replace(BASE, policy="random", load=0.97))
    bal = run_cells(replace(BASE, policy="balancer", load=0.97))
    assert bal.shed > 0.0 and rnd.shed == 0.0
    assert bal.goodput > rnd.goodput and bal.p99_wait < rnd.p99_wait


def test_headroom_against_autoscaling():
    fast, slow = DayConfig(delay_min=2.0), DayConfig(delay_min=30.0)
    static_good, static_h = run_day(replace(fast, headroom=0.1), static=True)
    lean_fast, h_fast = run_day(replace(fast, headroom=0.0), static=False)
    lean_slow, _ = run_day(replace(slow, headroom=0.0), static=False)
    padded_slow, h_padded = run_day(replace(slow, headroom=0.25), static=False)
    assert static_good == pytest.approx(1.0)
    assert h_fast < 0.7 * static_h  # following the daily curve costs far less
    assert lean_slow < lean_fast  # a slow start loses the ramp and the burst
    assert padded_slow > lean_slow and h_padded < static_h
