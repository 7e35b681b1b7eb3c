"""Steps with prompt chunks as CUDA graphs: one graph per token bucket (16, 32, 64, ... up to
`MAX_GRAPH_TOKENS`), a step padded up to the nearest bucket and replayed. Decode-only steps keep
`cuda_graphs.DecodeGraphs` (the split decode kernel); steps past the largest bucket, steps that
score prompt tokens, and steps with more sampled rows than a bucket holds run eagerly (launch
costs are small next to their arithmetic).

A bucket's shapes are fixed, so everything a step varies lives in device buffers the graph
reads: token ids, positions and cache slots per row; the decode rows' block tables and context
lengths, padded to the bucket's most sequences, for the split decode kernel
(`triton_attention`); and every prompt chunk as the varlen prefill kernel takes it
(`triton_prefill`): first row, length, cached prefix, block table, and the kernel's query tiles.
The decode kernel runs over all its padded rows (a padding row attends to one cached token) and
writes rows the prefill kernel then overwrites with its chunks' rows. The tile size is the
bucket's (`bucket_block_m`), and the tile list is padded to the most tiles the bucket's rows can
need; padding tiles name an empty chunk and do no work. Padding rows read token 0 at position 0
and write their K/V into a scratch block beyond the pool, so they never touch a real sequence's
cache; their outputs are never read (every op of a step is per row but attention, which never
reads them). Sampled rows are picked inside the graph from a fixed-size index list (padding
picks row 0), so the head runs on those rows only.

`MixedStepInputs` is the device-agnostic half (the buffers, how a step fills them, the forward
they feed) and runs eagerly anywhere; `MixedGraphs` captures and replays its forwards on CUDA."""

from __future__ import annotations

import bisect

import torch

from batcher.core.outputs import SchedulerOutput
from batcher.runtime.attention import AttentionMetadata
from batcher.runtime.step_rows import CopyFence, host_buffer, lay_out, write_rows

# The largest step captured: past it, a step's matmuls outweigh its launches.
MAX_GRAPH_TOKENS = 512
MIN_GRAPH_TOKENS = 16


def token_buckets(max_tokens: int, top: int = MAX_GRAPH_TOKENS) -> list[int]:
    """Powers of two from 16 up to min(`max_tokens`, `top`), and that bound itself."""
    cap = min(max_tokens, top)
    sizes = []
    b = MIN_GRAPH_TOKENS
    while b < cap:
        sizes.append(b)
        b *= 2
    return sizes + [cap]


def bucket_block_m(tokens: int) -> int:
    """Query rows per program of a bucket's prompt chunks, a power of two: 16 (the kernel's
    least) up to 255 tokens, then 32, then 64 (the kernel's most) from 512, so long chunks read
    their keys in fewer tiles. Not tuned by measurement (docs/gpu-kernels.md)."""
    return min(64, max(16, 1 << ((tokens // 8).bit_length() - 1)))


class MixedStepInputs:
    """The fixed-shape inputs of one token bucket: a step of up to `tokens` rows and
    `max_seqs` sequences, each sequence's context within `max_blocks` blocks."""

    def __init__(self, tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 scratch_slot: int, device: torch.device):
        from batcher.runtime.triton_prefill import VarlenPrefill, tiles_of

        self._tiles_of = tiles_of  # the kernel's tile layout (imported where Triton is)
        self.tokens = tokens
        self.max_seqs = min(tokens, max_seqs)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.block_m = bucket_block_m(tokens)
        # Each chunk needs ceil(length / block_m) tiles: at most tokens / block_m + one per chunk.
        self.max_tiles = -(-tokens // self.block_m) + self.max_seqs
        self.rows_out = self.max_seqs  # sampled rows the head computes
        d = self.max_seqs  # decode rows the decode kernel runs over
        c = self.max_seqs + 1  # chunks: the last is always empty, and padding tiles name it
        self._index_layout = (d, c)
        self._fence = CopyFence()
        # [ids, positions, slots] per row, then the sampled rows' indices.
        self._host_rows = host_buffer(3 * tokens + self.rows_out, dtype=torch.long, device=device)
        # The decode rows' lengths [d]; the chunks [3, c]; the tiles [2, tiles]: flat.
        self._host_index = host_buffer(d + 3 * c + 2 * self.max_tiles, dtype=torch.int32,
                                       device=device)
        # Block tables: the decode rows', then the chunks'.
        self._host_tables = host_buffer(d + c, max_blocks, dtype=torch.int32, device=device)
        self.rows = torch.zeros_like(self._host_rows, device=device)
        self.index = torch.zeros_like(self._host_index, device=device)
        self.tables = torch.zeros_like(self._host_tables, device=device)
        t = tokens
        self.ids, self.positions, self.slots = (self.rows[i * t:(i + 1) * t] for i in range(3))
        self.logits_rows = self.rows[3 * t:]
        self.decode_lens = self.index[:d]
        self.decode_tables = self.tables[:d]
        self.varlen = VarlenPrefill(self.tables[d:], self.index[d:d + 3 * c].view(3, c),
                                    self.index[d + 3 * c:].view(2, self.max_tiles), self.block_m)
        # numpy views of the host buffers: a step writes its lists through them (a torch op
        # per slice costs several times more, on every replayed step).
        self._rows_np = self._host_rows.numpy()
        self._index_np = self._host_index.numpy()
        self._reset_host()
        self.rows.copy_(self._host_rows)
        self.index.copy_(self._host_index)

    def _reset_host(self) -> None:
        """The host buffers as an empty step: padding everywhere."""
        d, c = self._index_layout
        t = self.tokens
        rows, idx = self._rows_np, self._index_np
        rows.fill(0)
        rows[2 * t:3 * t] = self.scratch_slot
        idx.fill(0)
        idx[:d] = 1  # a padding decode row attends to one token (block 0's first)
        idx[d + 3 * c:d + 3 * c + self.max_tiles] = c - 1  # padding tiles: the empty chunk

    def takes(self, sched: SchedulerOutput) -> bool:
        """Whether `sched` fits this bucket (its prompt logprobs aside: the runner checks)."""
        seqs = sched.seqs
        if len(seqs) > self.max_seqs or sched.num_batched_tokens > self.tokens:
            return False
        if sum(1 + len(s.draft_token_ids) for s in seqs if s.sample) > self.rows_out:
            return False
        bs = self.block_size
        return all((s.start_pos + len(s.token_ids) - 1) // bs < self.max_blocks for s in seqs)

    def fill(self, sched: SchedulerOutput) -> int:
        """Copy `sched` into the buffers -> how many rows it samples (the logits' first rows)."""
        step = lay_out(sched, self.block_size)
        self._fence.wait()
        self._reset_host()
        t, n = self.tokens, len(step.ids)
        d, c = self._index_layout
        rows = self._rows_np
        rows[:n] = step.ids
        rows[t:t + n] = step.positions
        rows[2 * t:2 * t + n] = step.slots
        rows[3 * t:3 * t + len(step.sample_rows)] = step.sample_rows
        idx = self._index_np
        nd, k = len(step.decode_lens), len(step.chunks)
        idx[:nd] = step.decode_lens
        if k:
            idx[d:d + 3 * c].reshape(3, c)[:, :k] = list(zip(*step.chunks))
        tile_seq, tile_first = self._tiles_of([ch[1] for ch in step.chunks], self.block_m)
        tiles = idx[d + 3 * c:].reshape(2, self.max_tiles)
        tiles[0, :len(tile_seq)] = tile_seq
        tiles[1, :len(tile_first)] = tile_first
        # Tables past the step's rows are not copied: an empty chunk's is never read, and a
        # padding decode row reads entry 0 of its row, a valid block id from any step.
        tables = self._host_tables
        write_rows(tables, [*range(nd), *range(d, d + k)], step.tables)
        self.rows.copy_(self._host_rows, non_blocking=True)
        self.index.copy_(self._host_index, non_blocking=True)
        if nd:
            self.tables[:nd].copy_(tables[:nd], non_blocking=True)
        if k:
            self.tables[d:d + k].copy_(tables[d:d + k], non_blocking=True)
        self._fence.copied(self._host_rows.is_pinned())
        return len(step.sample_rows)

    def metadata(self) -> AttentionMetadata:
        """Every padded decode row through the decode kernel, then the chunks through the
        varlen kernel (`attention.paged_attention`)."""
        return AttentionMetadata(block_size=self.block_size, slot_mapping=self.slots,
                                 num_decodes=self.max_seqs, decode_tables=self.decode_tables,
                                 decode_lens=self.decode_lens, triton_prefill=True,
                                 varlen=self.varlen)

    def forward(self, model: torch.nn.Module, kv_caches: list) -> torch.Tensor:
        """The model over the buffers -> logits [max sampled rows, vocab]."""
        return model(self.ids, self.positions, self.metadata(), kv_caches, self.logits_rows)


def pick_bucket(buckets: list[MixedStepInputs], sched: SchedulerOutput) -> int | None:
    """Index of the smallest bucket `sched` fits, or None."""
    i = bisect.bisect_left([b.tokens for b in buckets], sched.num_batched_tokens)
    for j in range(i, len(buckets)):
        if buckets[j].takes(sched):
            return j
    return None


class MixedGraphs:
    """Captured graphs of a ModelRunner's steps with prompt chunks (model, KV cache and scratch
    block fixed), one per token bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int,
                 scratch_block: int, max_blocks: int, max_seqs: int, max_tokens: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = [MixedStepInputs(t, max_seqs, max_blocks, block_size,
                                        scratch_block * block_size, device)
                        for t in token_buckets(max_tokens)]
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list[torch.Tensor] = []
        self._picked: tuple[SchedulerOutput | None, int | None] = (None, None)
        self._capture(device)

    def _capture(self, device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in self.buckets:  # warm-up: kernels compiled, lazy tables built
                b.forward(self.model, self.kv_caches)
        torch.cuda.current_stream(device).wait_stream(stream)
        pool = None
        graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for i in sorted(range(len(self.buckets)), key=lambda i: -self.buckets[i].tokens):
            g = torch.cuda.CUDAGraph()  # largest first: smaller ones reuse its pool
            with torch.cuda.graph(g, pool=pool):
                out = self.buckets[i].forward(self.model, self.kv_caches)
            pool = g.pool()
            graphs[i] = (g, out)
        self.graphs = [graphs[i][0] for i in range(len(self.buckets))]
        self.outputs = [graphs[i][1] for i in range(len(self.buckets))]
        torch.cuda.synchronize(device)

    def can_run(self, sched: SchedulerOutput) -> bool:
        # The bucket is kept for `run`, which follows for the same step.
        self._picked = (sched, pick_bucket(self.buckets, sched) if sched.seqs else None)
        return self._picked[1] is not None

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """Replay the smallest bucket that holds `sched` -> logits [sampled rows, vocab], in
        the order `ModelRunner.prepare` gives them."""
        picked_for, i = self._picked
        if picked_for is not sched:
            i = pick_bucket(self.buckets, sched)
        assert i is not None
        n = self.buckets[i].fill(sched)
        self.graphs[i].replay()
        return self.outputs[i][:n]
