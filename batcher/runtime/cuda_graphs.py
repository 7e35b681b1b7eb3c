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
from batcher.runtime.block_table_rows import write_rows


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
        # Host staging, pinned (on CUDA) so the copies are asynchronous.
        self._host = torch.zeros(4, top, dtype=torch.long)
        self._host_tables = torch.zeros(top, max_blocks, dtype=torch.int32)
        if device.type == "cuda":
            self._host, self._host_tables = self._host.pin_memory(), self._host_tables.pin_memory()
        self._host_np = self._host.numpy()  # a step writes its lists through it
        self._copied: torch.cuda.Event | None = None  # after the last step's copies
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

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """Replay the graph for a decode-only step -> logits [n, vocab] in scheduled order."""
        seqs = sched.seqs
        n = len(seqs)
        b = pick_size(n, self.sizes)
        assert b is not None
        if self._copied is not None:  # the last step's copies have read the host buffers
            self._copied.synchronize()
        host, tables = self._host, self._host_tables
        h = self._host_np
        h[:, n:b] = 0
        h[2, n:b] = self.scratch_slot
        h[3, n:b] = 1
        bs = self.block_size
        pos = [s.start_pos for s in seqs]
        h[0, :n] = [s.token_ids[0] for s in seqs]
        h[1, :n] = pos
        h[2, :n] = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        h[3, :n] = [p + 1 for p in pos]
        # Padding rows read entry 0 of their table row: any valid block id.
        write_rows(tables, range(n), [s.block_ids[:p // bs + 1] for s, p in zip(seqs, pos)])
        self.ids[:b].copy_(host[0, :b], non_blocking=True)
        self.positions[:b].copy_(host[1, :b], non_blocking=True)
        self.slots[:b].copy_(host[2, :b], non_blocking=True)
        self.lens[:b].copy_(host[3, :b], non_blocking=True)
        self.tables[:b].copy_(tables[:b], non_blocking=True)
        if host.is_pinned():
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.graphs[b].replay()
        return self.outputs[b][:n]
