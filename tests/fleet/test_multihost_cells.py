"""The two-cell demo as a test: a cell on each of two network namespaces, the balancer on a
third; cell B's link cut and restored mid-run. Skipped where network namespaces cannot be made."""

from __future__ import annotations

import pytest

from tests.fleet.netns_demo import run_demo

pytestmark = pytest.mark.slow


def test_a_cell_cut_mid_run_loses_nothing():
    run_demo("bmc", "cells", timeout=180)
