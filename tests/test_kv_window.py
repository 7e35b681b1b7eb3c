"""Blocks behind a sliding window: freed as a request moves on, with positions kept, the prefix
cache still exact, and every block back in the pool at the end."""

from __future__ import annotations

import pytest

from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.request import Request

BS = 4


def _advance(kv: KVCacheManager, req: Request, n: int) -> None:
    """Compute the next `n` tokens of `req` as a step would, then settle its blocks."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    kv.release_behind_window(req)
    kv.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_wholly_behind_the_window_are_freed(caching: bool) -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=caching, sliding_window=6)
    req = Request("a", list(range(100, 130)))
    computed, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 9, computed)
    req.num_computed_tokens = 9
    kv.cache_full_blocks(req)
    kv.release_behind_window(req)
    # The next query (position 9) sees 4..9: block 0 (positions 0-3) is behind the window.
    assert kv.num_free_blocks == 8 - 2 and len(req.block_ids) == 3
    held = req.block_ids
    assert held[0] == held[1]  # a placeholder: a block the request still holds
    _advance(kv, req, 11)  # next query at 20 sees 15..20: blocks 0-2 behind
    assert len(req.block_ids) == 5 and len(set(req.block_ids[3:])) == 2
    assert kv.num_free_blocks == 8 - 2
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_no_window_keeps_every_block() -> None:
    kv = KVCacheManager(8, BS)
    req = Request("a", list(range(30)))
    assert kv.allocate_slots(req, 20, [])
    req.num_computed_tokens = 20
    kv.cache_full_blocks(req)
    kv.release_behind_window(req)
    assert kv.num_free_blocks == 3 and len(set(req.block_ids)) == 5


def test_released_blocks_stay_exact_prefix_hits_until_reused() -> None:
    """A released block keeps its hash while its K/V is intact, so another request with the
    same prefix may hit it; once the pool reuses it the chain through it ends there."""
    kv = KVCacheManager(6, BS, sliding_window=5)
    prompt = list(range(200, 216))
    a = Request("a", prompt + [1, 2, 3, 4])
    assert kv.allocate_slots(a, 16, [])
    a.num_computed_tokens = 16
    original = list(a.block_ids)
    kv.cache_full_blocks(a)
    kv.release_behind_window(a)  # the query at 16 sees 12..16: blocks 0-2 behind
    assert kv.num_free_blocks == 6 - 1
    b = Request("b", prompt + [9, 9])
    blocks, hit = kv.get_computed_blocks(b)
    assert (blocks, hit) == (original, 16)  # the released blocks, not a's placeholders
    assert a.block_ids[:3] != original[:3]
    kv.free(a)
    # Fresh blocks come from the never-hashed ones first; reusing all of them evicts the chain.
    c = Request("c", list(range(24)))
    assert kv.allocate_slots(c, 24, [])
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.check_integrity()
