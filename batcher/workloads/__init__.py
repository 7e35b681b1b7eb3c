"""Files that ship inside the package (installed copies have no repository around them): the
default workload of `batcher bench` and the calibrated CPU step-time model of `batcher sim`.
In a checkout, `workloads/` at the root points at the same folder."""

from __future__ import annotations

from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent
DEFAULT_WORKLOAD = WORKLOADS / "chat64.json"
DEFAULT_STEP_MODEL = WORKLOADS / "step_time_cpu.json"
