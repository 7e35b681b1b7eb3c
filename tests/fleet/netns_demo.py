"""Runs the multi-host demo script in network namespaces for the tests: skips where namespaces
cannot be made, stops the script on a timeout (its trap removes what it made), checks that no
namespace is left behind, and returns the script's RESULT record."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multihost_demo.sh"


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None. Tries to make (and remove) one."""
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    name = f"bchk{uuid.uuid4().hex[:10]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=10, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip() or made.returncode}"
    try:  # the demo also needs veth pairs, which some sandboxes refuse
        veth = subprocess.run(["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer",
                               "name", "v1"], capture_output=True, text=True, timeout=10,
                              check=False)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10,
                       check=False)
    if veth.returncode != 0:
        return f"veth pairs cannot be made here: {veth.stderr.strip() or veth.returncode}"
    return None


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10,
                         check=True)
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith(prefix)]


def run_demo(prefix: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run the demo with `args` under a fresh namespace prefix; return its RESULT record with
    every check passed (skip where namespaces cannot be made)."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    run_id = f"{prefix}{uuid.uuid4().hex[:6]}"  # the script's namespaces all start with this
    env = dict(os.environ, PYTHON=sys.executable, MULTIHOST_ID=run_id)
    p = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the script's trap removes what it made
        out, _ = p.communicate(timeout=30)
        pytest.fail(f"the demo did not finish in {timeout:g} s:\n{out[-3000:]}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert namespaces(run_id) == [], "the demo left namespaces behind"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, out[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    assert all(result["checks"].values()), result["checks"]
    assert result["failed"] == 0 and result["requests"] >= 50
    return result
