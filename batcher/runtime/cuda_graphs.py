"""Decode steps as CUDA graphs: one graph per batch size in a ladder (1, 2, 4, 8, 16, 24, 32,
...), a decode-only step padded up to the nearest captured size and replayed. Prefill chunks and
odd shapes run eagerly. Needs the fused decode kernel (fixed shapes, no per-step gather).

Padded rows read block 0 with a context of one token and write their K/V into a scratch block
beyond the pool, so they never touch a real sequence's cache."""

from __future__ import annotations

import bisect

import torch

from batcher.core.outputs import SchedulerOutput
from batcher.runtime.attention import AttentionMetadata
from batcher.runtime.step_rows import CopyFence, host_buffer, lay_out, write_rows


def graph_sizes(max_batch: int) -> list[int]:
    """The capture ladder up to `max_batch`: powers of two to 16, then steps of 16."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def pick_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `n` rows, or None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured decode graphs of one ModelRunner (model, KV cache and scratch block fixed)."""

    def __init__(self, model, kv_caches, block_size: int, scratch_block: int, max_blocks: int,
                 sizes: list[int], device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.max_blocks = max_blocks
        self.sizes = sizes
        top = max(sizes)
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.ones(top, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, device=device)
        # Host staging: [ids, positions, slots, lengths] per row, and the block tables.
        self._host = host_buffer(4, top, dtype=torch.long, device=device)
        self._host_tables = host_buffer(top, max_blocks, dtype=torch.int32, device=device)
        self._host_np = self._host.numpy()  # a step writes its lists through it
        self._fence = CopyFence()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(device)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(block_size=self.block_size, slot_mapping=self.slots[:b],
                                 num_decodes=b, decode_tables=self.tables[:b],
                                 decode_lens=self.lens[:b])

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.positions[:b], self._meta(b), self.kv_caches,
                          self.rows[:b])

    def _capture(self, device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in self.sizes:  # warm-up: kernels compiled, lazy tables built
                self._forward(b)
        torch.cuda.current_stream(device).wait_stream(stream)
        pool = None
        for b in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(device)

    def can_run(self, sched: SchedulerOutput) -> bool:
        seqs = sched.seqs
        # Every row samples (the logits come back in row order): a prompt's one-token chunk
        # that does not end it is a step for `mixed_graphs` or the eager path.
        if not seqs or sched.num_decodes != len(seqs) or not all(s.sample for s in seqs):
            return False
        if pick_size(len(seqs), self.sizes) is None:
            return False
        return all(s.start_pos // self.block_size < self.max_blocks for s in seqs)

    def run(self, sched: SchedulerOutput, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph for a decode-only step -> logits [n, vocab] in scheduled order.
        `fed`: the rows' input tokens on the device (a step scheduled ahead), in place of the
        placeholders its rows hold."""
        seqs = sched.seqs
        n = len(seqs)
        b = pick_size(n, self.sizes)
        assert b is not None
        step = lay_out(sched, self.block_size)
        self._fence.wait()
        host, tables = self._host, self._host_tables
        h = self._host_np
        h[:, n:b] = 0
        h[2, n:b] = self.scratch_slot
        h[3, n:b] = 1
        h[0, :n] = step.ids
        h[1, :n] = step.positions
        h[2, :n] = step.slots
        h[3, :n] = step.decode_lens
        # Padding rows read entry 0 of their table row: any valid block id.
        write_rows(tables, range(n), step.tables)
        self.ids[:b].copy_(host[0, :b], non_blocking=True)
        self.positions[:b].copy_(host[1, :b], non_blocking=True)
        self.slots[:b].copy_(host[2, :b], non_blocking=True)
        self.lens[:b].copy_(host[3, :b], non_blocking=True)
        self.tables[:b].copy_(tables[:b], non_blocking=True)
        self._fence.copied(host.is_pinned())
        if fed is not None:  # after the copy of the placeholders, in the stream's order
            self.ids[:n].copy_(fed, non_blocking=True)
        self.graphs[b].replay()
        return self.outputs[b][:n]
