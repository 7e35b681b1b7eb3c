"""Shared helpers of the bench scripts; they live in `batcher.bench.common` so `batcher bench`
can use them from an installed package too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batcher.bench.common import (  # noqa: F401
    BENCHMARKS,
    DEFAULT_WORKLOAD,
    ROOT,
    append_rows,
    command_line,
    load_workload,
    machine,
    pct,
    wait_until_up,
)
