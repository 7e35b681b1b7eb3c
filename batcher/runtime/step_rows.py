"""A step's rows as captured graphs take them (`cuda_graphs`, `mixed_graphs`), and the host side
of writing them into a graph's buffers: the layout, the host buffers, the block tables in one
pass, and the fence that keeps a step from rewriting buffers still being copied.

With a GPU step of about a millisecond, the host's time to fill a replayed step's inputs is the
step's floor. Row by row (a small tensor and a slice assignment each) the block tables cost about
20 us a row: 5 ms for 256 decode rows. Here every row's ids are gathered into one array and
scattered into the table with one fancy-index assignment, and the other rows are written through
numpy views of the host buffers. Entries past a row's ids are left as they are: the kernels read
a row's table only below its context length, and whatever an earlier step left there is a valid
block id anyway."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batcher.core.outputs import SchedulerOutput


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
    if lens.max() > width:
        raise ValueError(f"{int(lens.max())} block ids for a table {width} wide")
    values = np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int32, count=total)
    firsts = np.asarray(rows, dtype=np.int64) * width - (np.cumsum(lens) - lens)
    flat = table.numpy().reshape(-1)
    flat[np.arange(total) + np.repeat(firsts, lens)] = values


def host_buffer(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host buffer staging a graph's inputs, pinned where they go to CUDA (so the
    copies are asynchronous)."""
    t = torch.zeros(*shape, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


class CopyFence:
    """Keeps a step from rewriting pinned host buffers that the previous step's asynchronous
    copies may still be reading: a step that samples nothing never syncs with the device."""

    def __init__(self) -> None:
        self._copied: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Before writing the host buffers: the last copies from them have run."""
        if self._copied is not None:
            self._copied.synchronize()

    def copied(self, pinned: bool) -> None:
        """After queueing the copies from the host buffers (`pinned`: they are asynchronous)."""
        if pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()


@dataclass(slots=True, frozen=True)
class StepRows:
    """A step laid out row by row in scheduled order (decode rows first), as a bucket's buffers
    take it."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_lens: list[int]  # per decode row: the tokens it attends to, its own included
    chunks: list[tuple[int, int, int]]  # per prompt chunk: first row, length, cached prefix
    tables: list[list[int]]  # per sequence: the blocks its context covers
    sample_rows: list[int]  # rows whose logits are sampled, in `verify_rows` order


def lay_out(sched: SchedulerOutput, block_size: int) -> StepRows:
    """The step's rows, its decode rows' lengths and its chunks; a row with drafts samples each
    of its positions (as `ModelRunner.prepare` orders them)."""
    chunks: list[tuple[int, int, int]] = []
    bs = block_size
    nd = sched.num_decodes
    seqs = sched.seqs
    # The decode rows (first): one token each, laid out list by list (a host cost per row of
    # every replayed step).
    starts = [s.start_pos for s in seqs[:nd]]
    ids = [s.token_ids[0] for s in seqs[:nd]]
    positions = list(starts)
    slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, starts)]
    decode_lens = [p + 1 for p in starts]
    tables = [s.block_ids[:p // bs + 1] for s, p in zip(seqs, starts)]
    sample_rows = [i for i, s in enumerate(seqs[:nd]) if s.sample]
    for s in seqs[nd:]:
        n = len(s.token_ids)
        row = len(ids)
        ids.extend(s.token_ids)
        pos = range(s.start_pos, s.start_pos + n)
        positions.extend(pos)
        slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
        chunks.append((row, n, s.start_pos))
        tables.append(s.block_ids[:-(-(s.start_pos + n) // bs)])
        if s.sample:
            last = row + n - 1
            sample_rows.extend(range(last - len(s.draft_token_ids), last + 1))
    return StepRows(ids, positions, slots, decode_lens, chunks, tables, sample_rows)
