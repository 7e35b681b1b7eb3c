"""Contiguous K/V of a prompt that is read in several chunks.

A continued prefill chunk attends over its whole context in every layer. Read from the paged
cache, that context is first gathered block by block into one tensor, in every layer of every
step, however short the chunk: on a CPU at 2k tokens of context the gather was a quarter of a
short chunk's attention time (SmolLM2-135M, bf16, one thread: 4.5 of 18 ms a step for a 2-token
chunk), and under a time-sized budget that is the steady case, since late in a long prompt only a
few tokens fit each step.

So while a sequence prefills in chunks it also keeps its K/V per layer in one contiguous buffer,
`[kv_heads, capacity, head_dim]`: each chunk appends its own K/V there and its attention reads
the buffer in place. The paged cache is still written as always (decodes, prefix caching and
preemption read it); the buffer is a copy held only while the prompt is read, dropped when its
last chunk ran or the sequence was freed, within a byte budget (past it, chunks gather as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Initial room, in tokens, of a buffer started by a first chunk: the prompt's length is not known
# to the runner, so the buffer doubles as it fills (each token is copied at most about twice).
_MIN_CAPACITY = 512
# A buffer unused for this many steps is dropped: the engine skips empty steps, so the runner may
# never hear that an aborted request was freed. One that is still prefilling refills, correctly,
# from the paged cache on its next chunk.
MAX_IDLE_STEPS = 64


@dataclass(slots=True)
class _Layer:
    k: torch.Tensor  # [kv_heads, capacity, head_dim]
    v: torch.Tensor
    filled: int = 0  # positions [0, filled) hold this sequence's K/V


@dataclass(slots=True)
class StagedKV:
    """One sequence's staged K/V. Layers are told apart by their K cache tensor, allocated
    lazily on first use and regrown to `capacity` when the sequence outgrows them."""

    capacity: int
    layers: dict[int, _Layer] = field(default_factory=dict)
    last_step: int = 0  # the runner's step that last used it

    def context(self, kv_cache: tuple[torch.Tensor, torch.Tensor], k_new: torch.Tensor,
                v_new: torch.Tensor, start_pos: int, block_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a chunk's K/V (`k_new`, `v_new`: [n, kv_heads, head_dim], positions from
        `start_pos`) and return K, V over its whole context: [1, kv_heads, start_pos + n,
        head_dim] views of the buffer. A layer whose buffer does not end exactly at `start_pos`
        (it began after a prefix-cache hit, or the sequence was preempted and is recomputed) is
        refilled from the paged cache through `block_ids`, the truth; the chunk's own K/V must
        already be written there."""
        k_cache, v_cache = kv_cache
        n, kvh, hd = k_new.shape
        ctx = start_pos + n
        assert ctx <= self.capacity, (ctx, self.capacity)
        layer = self.layers.get(id(k_cache))
        if layer is None or layer.k.shape[1] < self.capacity:
            layer = self._grow(layer, k_cache)
            self.layers[id(k_cache)] = layer
        if layer.filled != start_pos:
            # One gather of the whole context, the chunk included (write_kv ran first).
            k = k_cache.index_select(0, block_ids).view(-1, kvh, hd)[:ctx]
            v = v_cache.index_select(0, block_ids).view(-1, kvh, hd)[:ctx]
            layer.k[:, :ctx].copy_(k.transpose(0, 1))
            layer.v[:, :ctx].copy_(v.transpose(0, 1))
        else:
            layer.k[:, start_pos:ctx].copy_(k_new.transpose(0, 1))
            layer.v[:, start_pos:ctx].copy_(v_new.transpose(0, 1))
        layer.filled = ctx
        return layer.k[:, :ctx].unsqueeze(0), layer.v[:, :ctx].unsqueeze(0)

    def _grow(self, layer: _Layer | None, like: torch.Tensor) -> _Layer:
        kvh, hd = like.shape[-2:]
        shape = (kvh, self.capacity, hd)
        grown = _Layer(torch.empty(shape, dtype=like.dtype, device=like.device),
                       torch.empty(shape, dtype=like.dtype, device=like.device))
        if layer is not None and layer.filled:
            grown.k[:, :layer.filled].copy_(layer.k[:, :layer.filled])
            grown.v[:, :layer.filled].copy_(layer.v[:, :layer.filled])
            grown.filled = layer.filled
        return grown


class PrefillStaging:
    """The runner's staged sequences, by request id, within `budget_bytes` of buffers.
    `bytes_per_token`: K and V of one token in every layer. Used from the model thread only."""

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._seqs: dict[str, StagedKV] = {}
        self._step = 0

    @property
    def staged_tokens(self) -> int:
        """Capacity held, in tokens, over every staged sequence."""
        return sum(s.capacity for s in self._seqs.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def begin_step(self, freed_ids: list[str]) -> None:
        """Start a step: drop the buffers of freed sequences and of any left idle too long."""
        self._step += 1
        if not self._seqs:
            return
        self.release_all(freed_ids)
        idle = [rid for rid, s in self._seqs.items() if self._step - s.last_step > MAX_IDLE_STEPS]
        self.release_all(idle)

    def for_chunk(self, request_id: str, start_pos: int, num_tokens: int,
                  last: bool) -> StagedKV | None:
        """The buffer a prefill chunk of this sequence reads and appends to, or None (attend
        through the paged cache). `last`: the chunk ends the prompt; such a chunk uses a buffer
        that exists and has room, but starts or grows none, as nothing would read it again."""
        ctx = start_pos + num_tokens
        staged = self._seqs.get(request_id)
        if staged is not None and ctx <= staged.capacity:
            staged.last_step = self._step
            return staged
        if last:
            self.release(request_id)
            return None
        held = staged.capacity if staged is not None else 0
        room = self.budget_bytes // self.bytes_per_token - (self.staged_tokens - held)
        capacity = max(ctx, min(max(2 * held, _MIN_CAPACITY), room))
        if capacity > room:
            self.release(request_id)  # over budget: this sequence reads the paged cache
            return None
        if staged is None:
            staged = self._seqs[request_id] = StagedKV(capacity)
        staged.capacity = capacity  # layers regrow to it on their next use
        staged.last_step = self._step
        return staged

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def release_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)
