"""The gpu bench scenario (`python -m scripts.bench gpu`) runs end to end on the CPU with the tiny
model: decode step against the floor, the engine built as `batcher serve` builds it, and the
transformers baseline on the same device and prompts. The scenario is otherwise run only on a GPU,
where a crash costs a whole run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_bench_gpu_runs_on_cpu_with_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "gpu", "--device", "cpu", "--model", "tiny",
         "--dtype", "float32", "--requests", "3", "--max-tokens", "6", "--batches", "2",
         "--ctx", "32", "--hf-batches", "2", "--no-append", "--json", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    (step,) = res["decode"]
    assert step["batch"] == 2 and step["ctx"] == 32
    assert step["step_ms"] > 0 and step["floor_ms"] > 0 and step["ratio"] > 0
    chat = res["chat"]
    assert chat["requests"] == 3 and chat["engine"]["exact"] and chat["hf"]["2"]["exact"]
    assert chat["speedup"] > 0 and chat["best_hf_batch"] == 2
    assert "chat3 engine" in proc.stdout
