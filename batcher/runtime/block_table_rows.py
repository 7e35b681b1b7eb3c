"""Writing a step's block tables into a captured graph's host buffer in one vectorised pass.

A replayed step copies its rows' block ids into a fixed `[rows, max_blocks]` table. Row by row
(a small tensor and a slice assignment each) that cost about 20 us a row on the host: 5 ms for
256 decode rows, more than the GPU step it feeds. Here every row's ids are gathered into one
array and scattered into the table with one fancy-index assignment. Entries past a row's ids
are left as they are: the kernels read a row's table only below its context length, and
whatever an earlier step left there is a valid block id anyway."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


FEW_ROWS = 4


def write_rows(table: torch.Tensor, rows: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
    """`table[r, :len(b)] = b` for each row `r` of `rows` and its block ids `b` of `blocks`;
    `table`: a contiguous int32 tensor in host memory (pinned or not), each `b` no wider."""
    assert table.is_contiguous() and table.device.type == "cpu"
    if len(rows) <= FEW_ROWS:  # a few rows: a plain loop costs less than the setup below
        flat = table.numpy()
        for r, ids in zip(rows, blocks):
            flat[r, :len(ids)] = ids
        return
    width = table.shape[1]
    lens = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
    total = int(lens.sum())
    if lens.max() > table.shape[1]:
        raise ValueError(f"{int(lens.max())} block ids for a table {table.shape[1]} wide")
    values = np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int32, count=total)
    firsts = np.asarray(rows, dtype=np.int64) * width - (np.cumsum(lens) - lens)
    flat = table.numpy().reshape(-1)
    flat[np.arange(total) + np.repeat(firsts, lens)] = values
