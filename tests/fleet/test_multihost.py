"""The multi-host demo as a test: three network namespaces, a replica in two, the router in the
third; a link cut and restored mid-run. Skipped where network namespaces cannot be made."""

from __future__ import annotations

import pytest

from tests.fleet.netns_demo import run_demo

pytestmark = pytest.mark.slow


def test_link_cut_loses_nothing_evicts_and_readmits_and_routes_to_both():
    result = run_demo("bmt", timeout=90)
    a, b = "10.200.1.2:8000", "10.200.2.2:8000"
    assert result["served_while_cut"][b] == 0
    # KV is a fit constraint, a score only when scarce: with room on both, both take work.
    assert result["served_both_up"][a] > 0 and result["served_both_up"][b] > 0
