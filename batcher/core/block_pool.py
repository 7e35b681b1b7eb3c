"""KV blocks: ref counts, an O(1) LRU of free blocks, and the prefix cache (hash -> block).

A block is in exactly one of three states:

- used:   `ref_count > 0` (held by one or more running requests; shared prefix blocks have > 1);
- cached: `ref_count == 0` with a hash (its KV is still valid; a later request may reuse it);
- free:   `ref_count == 0` without a hash.

Cached and free blocks both sit in one LRU, so both count as allocatable. A fresh allocation takes
the LRU's head and drops that block's hash (eviction). Freed blocks with a hash go to the tail (the
most recently used, evicted last); freed blocks without a hash go to the head (worth nothing, so
reused first).

Every block id in `0 .. num_blocks - 1` is usable: there is no reserved null block.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: it covers the block's tokens and, through
    `parent_hash`, every token before them.

    NOTE: a cryptographic hash, not Python's `hash()`. Python's hash of ints is
    deterministic and cheap to invert, so one tenant could craft a prefix whose hash collides with
    another tenant's and plant KV computed under the wrong context. The per-block token compare in
    `BlockPool.lookup` cannot catch a collision in the *parent* hash; a 128-bit BLAKE2b makes that
    infeasible. Cost: under 1 us per block, and each request hashes each block once.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@functools.lru_cache(maxsize=4096)
def scope_root(scope: str) -> BlockHash:
    """The root of every hash chain in one sharing scope (a tenant): the first block's parent.
    Chains of different scopes never meet, so neither do their cached blocks."""
    return hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"batcher-scope").digest()


@dataclass(slots=True)
class Block:
    """One block of `block_size` token slots. `block_hash`, `parent_hash` and `token_ids` are set
    only while the block is registered in the prefix cache (full and computed)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters: one query per admission of a request."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class BlockCounts:
    free: int
    cached: int
    used: int


class BlockPool:
    """Owns every block. Not thread-safe: only the scheduler (the engine's loop) touches it."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict gives O(1) pop-oldest, push-newest, push-to-head and removal from
        # the middle (a prefix hit on a cached block), which is all the LRU needs.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: free plus cached (evictable)."""
        return len(self._free)

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> Block | None:
        """The cached block for this exact chain link, or None. A hash hit only counts when the
        stored parent hash and token ids are equal too, so a collision is a miss, never wrong KV."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix hit); a cached one leaves the LRU."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with ref_count 1, evicting the least recently used cached ones."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out: list[int] = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            block.ref_count = 1
            self._uncache(block)
            out.append(bid)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given. Callers pass a sequence's blocks
        tail first, so its tail is evicted before its head (a shorter prefix is likelier reused)."""
        for bid in block_ids:
            block = self.blocks[bid]
            assert block.ref_count > 0, f"double free of block {bid}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[bid] = None
                if block.block_hash is None:
                    self._free.move_to_end(bid, last=False)

    def cache_block(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
    ) -> bool:
        """Register a full, computed, used block under its chained hash. Returns False (and leaves
        the block unregistered) when caching is off or another block already holds the hash."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, "only a block in use can be registered"
        if not self.enable_caching or block.block_hash is not None:
            return False
        # NOTE: first come wins. The holder is either the same content (a request that computed a
        # block another already cached: the copy stays unregistered and is reused first once
        # freed) or a collision, which must not replace a block other chains may point through.
        if block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        return True

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += num_hit_tokens

    def counts(self) -> BlockCounts:
        """O(num_blocks): for checks, tests and gauges, not for the hot path."""
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = sum(1 for b in self.blocks if b.ref_count == 0 and b.block_hash is not None)
        return BlockCounts(free=self.num_blocks - used - cached, cached=cached, used=used)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with `expected_refs` (block id -> holders), assert every
        ref count equals it (blocks not listed must have none)."""
        c = self.counts()
        assert c.free + c.cached + c.used == self.num_blocks, c
        assert len(self._free) == c.free + c.cached, (len(self._free), c)
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
                assert block.token_ids is not None, block
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_count == want, (block, want)
        assert all(b.block_hash == h for h, b in self._cached.items())

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
            # NOTE: a free block that lost its hash is worthless: move it to the LRU head.
            if block.ref_count == 0:
                self._free.move_to_end(block.block_id, last=False)
