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


def left_padded(group: list[dict]):
    """A static batch of workload requests for transformers' `generate`: token ids and attention
    mask left-padded to the longest prompt, and the new tokens the batch runs for (its longest
    member's). Torch is imported here, so scripts without it can use the rest."""
    import torch

    width = max(len(r["prompt_ids"]) for r in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for j, r in enumerate(group):
        n = len(r["prompt_ids"])
        ids[j, width - n:] = torch.tensor(r["prompt_ids"])
        mask[j, width - n:] = 1
    return ids, mask, max(r["max_new_tokens"] for r in group)
