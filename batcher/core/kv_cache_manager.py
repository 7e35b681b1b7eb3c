"""Which KV blocks each request holds: prefix-cache hits, slot allocation, freeing, fit checks.

The runner addresses KV by block id: token position `p` of a request lives in block
`request.block_ids[p // block_size]` at offset `p % block_size`. Every id below `num_blocks` is a
real block (no reserved null block), so a runner that pads block tables must mask the padding.

Sliding windows: when every layer of the model attends only to the last `sliding_window`
positions (Mistral-style), a block wholly behind the window of the request's next query is never
read again, so it is freed as the request moves on (`release_behind_window`). Its entry in
`block_ids` stays, pointing at a block the request still holds, so positions keep their index;
the attention masks those positions out, as it must for the window anyway. A freed block keeps
its prefix-cache hash like any freed block (it was registered before it was freed): its K/V is
intact until the pool reuses it, which drops the hash and ends every chain through it. Models
with some global layers (Gemma's interleaved ones) keep every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.core.block_pool import (
    BlockHash,
    BlockPool,
    PrefixCacheStats,
    hash_block_tokens,
    scope_root,
)
from batcher.core.request import Request

PREFIX_CACHE_SCOPES = ("tenant", "global")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _ReqState:
    """Per-request bookkeeping that survives between steps (dropped by `free`)."""

    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks
    num_cached_blocks: int = 0  # leading blocks already registered in (or hit from) the cache
    num_released: int = 0  # leading blocks freed behind the sliding window (placeholders now)


class KVCacheManager:
    """Allocates blocks to requests. Pure bookkeeping: it never sees a tensor.

    Contract with the scheduler: `get_computed_blocks` then `allocate_slots(..., computed_blocks)`
    when a request is admitted (and then the scheduler sets `num_computed_tokens` to the hit
    length); `allocate_slots(request, n)` before each later step; `cache_full_blocks` after each
    step; `free` exactly once when the request finishes, is aborted or is preempted.

    Prefix-cache scope: with `"tenant"` (the default) every hash chain starts from a root salted
    with the request's tenant, so blocks are shared only within one tenant, and a tenant can never
    learn (from `cached_tokens` or from latency) whether another sent a given prefix. `"global"`
    shares blocks across tenants, for operators who trust all of them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_scope: str = "tenant", sliding_window: int | None = None):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_scope = prefix_cache_scope
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Every layer's window, in tokens (None: some layer sees the whole context).
        self.sliding_window = sliding_window
        self._state: dict[str, _ReqState] = {}
        self._holders: dict[str, Request] = {}  # requests holding blocks, for integrity checks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation could take now (free plus evictable cached)."""
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Share of blocks in use by requests, 0..1 (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.pool.stats

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` fits in the free blocks right now, ignoring
        prefix hits (conservative: a hit only lowers the need)."""
        return self.blocks_needed(num_tokens) <= self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest chain of cached full blocks matching the request's leading tokens, as
        (block ids, number of tokens they cover). Takes no references (`allocate_slots` does).

        NOTE: the hit stops short of the last token, so a full-prompt hit still computes at least
        one token and yields logits; when the prompt ends on a block boundary the whole last block
        is recomputed rather than writing into a block that other requests share.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._hashes(request, max_blocks)
        tokens = request.token_ids
        block_ids: list[int] = []
        parent = self._root(request)
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            block_ids.append(block.block_id)
            parent = hashes[i]
        return block_ids, len(block_ids) * bs

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None,
        num_lookahead: int = 0,
    ) -> bool:
        """Grow `request.block_ids` so that it covers `num_computed_tokens` (plus the hit blocks)
        plus `num_new_tokens` plus `num_lookahead` drafted positions past the sequence's end
        (speculation; `trim` gives back what was not accepted). With `computed_blocks` (an
        admission: the request holds nothing), take a reference to each hit block first.
        Returns False and changes nothing when the free blocks are too few."""
        bs = self.block_size
        if computed_blocks is None and request.block_ids and (
                request.num_computed_tokens + num_new_tokens + num_lookahead
                <= len(request.block_ids) * bs):
            # NOTE: the common case, a decode inside its last block: nothing to allocate.
            assert request.num_computed_tokens + num_new_tokens <= request.num_tokens
            return True
        computed = computed_blocks or []
        assert not computed or (not request.block_ids and request.num_computed_tokens == 0)
        num_tokens = request.num_computed_tokens + len(computed) * bs + num_new_tokens
        assert num_tokens <= request.num_tokens, "cannot compute tokens not yet sampled"
        num_tokens += num_lookahead
        held = len(request.block_ids) + len(computed)
        num_fresh = max(0, cdiv(num_tokens, bs) - held)
        # NOTE: a hit on a cached (ref 0) block takes it out of the free LRU, so it cannot count
        # towards the fresh blocks as well.
        blocks = self.pool.blocks
        num_hits_in_lru = sum(1 for b in computed if blocks[b].ref_count == 0)
        if num_fresh > self.pool.num_free_blocks - num_hits_in_lru:
            return False
        if computed_blocks is not None and self.enable_prefix_caching:
            self.pool.record_query(request.num_tokens, len(computed) * bs)
        state = self._state.setdefault(request.request_id, _ReqState())
        # NOTE: a new list, never the old one grown: a scheduled row holds the request's list as
        # its block table (`core/scheduled_rows.py`) while the runner reads it.
        if computed:
            # NOTE: touch hits before allocating, so the allocation cannot evict them.
            self.pool.touch(computed)
            request.block_ids = request.block_ids + computed
            state.num_cached_blocks = len(computed)
        if num_fresh:
            request.block_ids = request.block_ids + self.pool.allocate(num_fresh)
        if request.block_ids:
            self._holders[request.request_id] = request
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache (after a step
        advanced `num_computed_tokens`), so later requests with the same prefix can reuse them."""
        if not self.enable_prefix_caching:
            return
        state = self._state.get(request.request_id)
        if state is None:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        if num_full <= state.num_cached_blocks:
            return
        hashes = self._hashes(request, num_full)
        tokens = request.token_ids
        root = self._root(request)
        for i in range(state.num_cached_blocks, num_full):
            self.pool.cache_block(
                request.block_ids[i],
                hashes[i],
                hashes[i - 1] if i else root,
                tuple(tokens[i * bs : (i + 1) * bs]),
            )
        state.num_cached_blocks = num_full

    def release_behind_window(self, request: Request) -> None:
        """Free the leading blocks that no query from `num_computed_tokens` on can see: a query
        at position q sees (q - sliding_window, q]. Registered blocks only (with prefix caching),
        so a placeholder entry is never registered in the cache."""
        window = self.sliding_window
        state = self._state.get(request.request_id)
        if window is None or state is None:
            return
        ids = request.block_ids
        behind = min(max(0, request.num_computed_tokens - window + 1) // self.block_size,
                     len(ids) - 1)
        if self.enable_prefix_caching:
            behind = min(behind, state.num_cached_blocks)
        if behind <= state.num_released:
            return
        self.pool.free(reversed(ids[state.num_released:behind]))
        # NOTE: a new list: the last step's ScheduledSeq may still refer to the old one.
        request.block_ids = [ids[behind]] * behind + ids[behind:]
        state.num_released = behind

    def trim(self, request: Request) -> None:
        """Release the blocks past those that `request.num_tokens` positions need: the tail a
        speculative step reserved for drafts that were not accepted. Such a block holds no
        accepted token, so it was never registered in the prefix cache."""
        keep = cdiv(request.num_tokens, self.block_size)
        if len(request.block_ids) <= keep:
            return
        state = self._state.get(request.request_id)
        assert state is None or state.num_cached_blocks <= keep, request.request_id
        assert state is None or state.num_released < keep, request.request_id
        tail = request.block_ids[keep:]
        # NOTE: a new list: the last step's ScheduledSeq may still refer to the old one.
        request.block_ids = request.block_ids[:keep]
        self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so tails are evicted first) and
        forget its bookkeeping. Registered blocks keep their hashes until reused."""
        self.pool.free(reversed(request.block_ids[self._released(request):]))
        # NOTE: a new list, not clear(): the last step's ScheduledSeq may still refer to the old.
        request.block_ids = []
        self._state.pop(request.request_id, None)
        self._holders.pop(request.request_id, None)

    def check_integrity(self) -> None:
        """Assert the pool's invariants and that every ref count equals the number of requests
        holding that block."""
        refs: dict[int, int] = {}
        for req in self._holders.values():
            held = req.block_ids[self._released(req):]
            assert len(set(held)) == len(held), req.request_id
            for bid in held:
                assert 0 <= bid < self.pool.num_blocks, bid
                refs[bid] = refs.get(bid, 0) + 1
        self.pool.check_integrity(refs)

    def holders(self) -> set[str]:
        """IDs of the requests that hold blocks."""
        return set(self._holders)

    def _released(self, request: Request) -> int:
        """How many leading `block_ids` entries are placeholders for blocks freed behind the
        window."""
        state = self._state.get(request.request_id)
        return 0 if state is None else state.num_released

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first `num_blocks` full blocks, computed once."""
        state = self._state.setdefault(request.request_id, _ReqState())
        hashes, bs, tokens = state.hashes, self.block_size, request.token_ids
        root = self._root(request) if len(hashes) < num_blocks else None
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _root(self, request: Request) -> BlockHash | None:
        """The parent of a request's first block: its tenant's salt, or None (global scope)."""
        return scope_root(request.tenant) if self.prefix_cache_scope == "tenant" else None
