"""The two-cell demo as a test: a cell on each of two network namespaces, the balancer on a
third; cell B's link cut and restored mid-run. Skipped where network namespaces cannot be made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.fleet.test_multihost import ROOT, namespaces, netns_unavailable

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "scripts" / "multihost_demo.sh"


def test_a_cell_cut_mid_run_loses_nothing():
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    run_id = f"bmc{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, PYTHON=sys.executable, MULTIHOST_ID=run_id)
    p = subprocess.Popen(["bash", str(SCRIPT), "cells"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the script's trap removes what it made
        out, _ = p.communicate(timeout=30)
        pytest.fail(f"the demo did not finish in 180 s:\n{out[-3000:]}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert namespaces(run_id) == [], "the demo left namespaces behind"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, out[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert all(result["checks"].values()), result["checks"]
    assert result["failed"] == 0 and result["requests"] >= 50
