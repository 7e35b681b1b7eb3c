"""The GPU path's host-side scenarios, run on the CPU: the launch count (`python -m scripts.bench
launches`, on the bundled model: its counts are a function of the step's shape alone, so they
are exact here and say what a GPU step launches, a floor since some torch ops launch more than
one kernel), and the host time to fill a replayed step's inputs (`graph_inputs`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def scenario_rows(*args: str) -> list[list[str]]:
    """The table rows a scenario prints (run with `args` and --no-append), split in columns."""
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", *args, "--no-append"],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [line.split(" | ") for line in proc.stdout.splitlines() if " | " in line]


def test_steps_with_a_prompt_chunk_launch_what_the_counts_say() -> None:
    rows = {cols[0]: cols for cols in scenario_rows("launches", "--decode-rows", "2", "--ctx",
                                                    "32", "--chunk", "8")}
    launches = {what.split(" (")[0]: int(cols[4]) for what, cols in rows.items()}
    attend = launches["eager, RoPE and cache write through torch's ops"]
    fused = launches["eager, RoPE and cache write in one kernel"]
    graph = launches["captured: graph nodes"]
    layers = 30
    # RoPE and the K/V writes through torch's ops are several launches a layer; one kernel here.
    assert attend - fused >= 4 * layers
    # Per layer in the graph: two norms, the QKV, output, gate/up and down projections, RoPE
    # with the cache write, decode and prefill attention, SiLU x up: ten; and the step's ends.
    assert 10 * layers <= graph <= 10 * layers + 8
    # A replay: the bucket's buffers (rows, the kernels' index, two runs of block tables) and
    # the graph.
    assert launches["captured: launches per replay"] == 5


def test_the_graph_inputs_scenario_runs() -> None:
    lines = scenario_rows("graph_inputs", "--rows", "1,9", "--ctx", "40", "--reps", "2")
    assert [(n, what) for n, what, *_ in lines if what == "decode fill"] == \
        [("1", "decode fill"), ("9", "decode fill")]
    assert all(float(ms.split()[0]) > 0 for _, _, ms, _ in lines)
