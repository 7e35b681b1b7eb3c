"""Block pool and KV cache manager: ref counts, LRU eviction, prefix hits, collisions, fit."""

from __future__ import annotations

import pytest

from batcher.core import kv_cache_manager
from batcher.core.block_pool import BlockPool, hash_block_tokens
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.request import Request


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens))


def _register(pool: BlockPool, bid: int, tag: int) -> bytes:
    h = hash_block_tokens(None, [tag])
    assert pool.cache_block(bid, h, None, (tag,))
    return h


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Admit `req` with its prefix hits, compute every token, register full blocks."""
    computed, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.check_integrity()
    return num_hit


def test_allocate_touch_free_keep_ref_counts() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 1
    pool.touch([ids[0]])
    pool.check_integrity({ids[0]: 2, ids[1]: 1, ids[2]: 1})
    pool.free(ids)
    pool.check_integrity({ids[0]: 1})
    assert pool.num_free_blocks == 3
    pool.free([ids[0]])
    assert pool.counts().free == 4
    with pytest.raises(AssertionError, match="double free"):
        pool.free([ids[0]])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_integrity_check_catches_a_wrong_ref_count() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity({})


def test_lru_evicts_oldest_first_and_a_sequences_tail_before_its_head() -> None:
    pool = BlockPool(6)
    a, b = pool.allocate(3), pool.allocate(3)
    for i, bid in enumerate(a + b):
        _register(pool, bid, i)
    pool.free(reversed(a))
    pool.free(reversed(b))
    assert pool.counts().cached == 6
    assert pool.allocate(6) == [a[2], a[1], a[0], b[2], b[1], b[0]]
    assert pool.counts().cached == 0
    pool.check_integrity({bid: 1 for bid in a + b})


def test_blocks_without_a_hash_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3)
    cached, plain = pool.allocate(2), pool.allocate(1)
    for i, bid in enumerate(cached):
        _register(pool, bid, i)
    pool.free(cached)
    pool.free(plain)  # freed last, but worth nothing
    assert pool.allocate(1) == plain


def test_freed_block_keeps_its_hash_until_reused() -> None:
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    h = _register(pool, bid, 7)
    pool.free([bid])
    hit = pool.lookup(h, None, (7,))
    assert hit is not None and hit.block_id == bid
    pool.touch([bid])  # a hit takes it out of the LRU: allocation cannot evict it
    (other,) = pool.allocate(1)
    assert other != bid and pool.num_free_blocks == 0
    pool.free([bid, other])
    pool.allocate(2)  # now both are reused and the hash is gone
    assert pool.lookup(h, None, (7,)) is None
    pool.check_integrity()


def test_lookup_needs_equal_tokens_and_parent_and_first_registration_wins() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    h = b"\x00" * 16  # one hash for everything: a forced collision
    assert pool.cache_block(a, h, None, (1, 2))
    assert not pool.cache_block(b, h, None, (3, 4))  # collision: not registered
    assert not pool.cache_block(c, h, None, (1, 2))  # same content: the copy stays plain
    assert pool.lookup(h, None, (1, 2)).block_id == a  # type: ignore[union-attr]
    assert pool.lookup(h, None, (3, 4)) is None
    assert pool.lookup(h, b"\x01" * 16, (1, 2)) is None
    pool.check_integrity({a: 1, b: 1, c: 1})


def test_chained_hash_depends_on_the_parent() -> None:
    root = hash_block_tokens(None, [1, 2])
    assert root == hash_block_tokens(None, [1, 2]) and len(root) == 16
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9]), [3, 4]
    )


def test_computed_blocks_are_the_longest_chain_short_of_the_last_token() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(100, 112))  # 3 full blocks
    a = _req("a", prompt)
    assert _admit(kv, a) == 0
    assert kv.get_computed_blocks(_req("same", prompt)) == (a.block_ids[:2], 8)
    assert kv.get_computed_blocks(_req("longer", prompt + [1]))[1] == 12
    assert kv.get_computed_blocks(_req("branch", prompt[:4] + [0] * 8))[1] == 4
    assert kv.get_computed_blocks(_req("other", [0] + prompt[1:]))[1] == 0
    kv.check_integrity()


def test_hits_on_cached_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(4, 4)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.counts().cached == 3
    too_big = _req("big", list(range(12)) + [5] * 5)  # 3 hit blocks + 2 fresh > 4
    computed, _ = kv.get_computed_blocks(too_big)
    assert computed == a_blocks
    assert not kv.allocate_slots(too_big, 5, computed)
    assert too_big.block_ids == [] and kv.num_free_blocks == 4 and kv.pool.counts().cached == 3
    fits = _req("fits", list(range(12)) + [5] * 4)  # 3 hit blocks + 1 fresh == 4
    assert _admit(kv, fits) == 12
    assert fits.block_ids[:3] == a_blocks and kv.num_free_blocks == 0
    kv.free(fits)
    kv.check_integrity()
    assert kv.pool.counts().used == 0


def test_allocate_slots_grows_block_ids_and_cache_full_blocks_registers_once() -> None:
    kv = KVCacheManager(8, 4)
    r = _req("r", [1, 2, 3])
    assert kv.allocate_slots(r, 3, []) and len(r.block_ids) == 1
    r.num_computed_tokens = 3
    kv.cache_full_blocks(r)
    assert kv.pool.counts().cached == 0  # block 0 is not full yet
    for tok in range(4, 10):  # decode one token at a time
        r.append_token(tok)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_full_blocks(r)
        kv.check_integrity()
    assert len(r.block_ids) == 3 and kv._state["r"].num_cached_blocks == 2
    assert kv.get_computed_blocks(_req("q", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 8


def test_duplicate_content_is_registered_once() -> None:
    kv = KVCacheManager(8, 4)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    for r in (a, b):  # both admitted before either was cached
        assert kv.allocate_slots(r, 9, kv.get_computed_blocks(r)[0])
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_full_blocks(r)
    kv.check_integrity()
    assert kv.pool.counts().used == 6 and len(kv.pool._cached) == 2
    b_blocks = list(b.block_ids)
    kv.free(b)  # b's copies carry no hash, so they are reused before never-used blocks
    assert set(kv.pool.allocate(3)) == set(b_blocks)
    kv.pool.check_integrity({bid: 1 for bid in a.block_ids + b_blocks})


def test_a_colliding_hash_never_serves_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, toks: b"\x00" * 16)
    kv = KVCacheManager(16, 4)
    _admit(kv, _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.get_computed_blocks(_req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)
    # Only a's first block is registered (the second collided), so that is all a twin hits.
    assert kv.get_computed_blocks(_req("twin", [1, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 4


def test_prefix_stats_fit_usage_and_disabled_caching() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.can_fit(32) and not kv.can_fit(33) and kv.usage == 0.0
    _admit(kv, _req("a", list(range(12))))
    _admit(kv, _req("b", list(range(12)) + [1]))
    assert kv.prefix_stats.queries == 2 and kv.prefix_stats.hit_tokens == 12
    assert kv.prefix_stats.query_tokens == 25 and kv.usage == 4 / 8  # 3 shared + 1
    off = KVCacheManager(8, 4, enable_prefix_caching=False)
    _admit(off, _req("a", list(range(12))))
    assert off.get_computed_blocks(_req("b", list(range(12)) + [1])) == ([], 0)
    assert off.pool.counts().cached == 0 and off.prefix_stats.queries == 0


def test_freeing_a_request_evicts_its_tail_before_its_head() -> None:
    kv = KVCacheManager(4, 4)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    kv.free(a)
    kv.pool.allocate(2)  # the never-used block, then a's last block
    assert kv.get_computed_blocks(_req("b", list(range(12)) + [1]))[1] == 8


def test_prefix_cache_is_shared_within_a_tenant_only_by_default() -> None:
    kv = KVCacheManager(32, 4)
    prompt = list(range(200, 213))  # 3 full blocks and one token
    alice = Request("alice-1", list(prompt), tenant="alice")
    assert _admit(kv, alice) == 0
    # Another tenant sending the same prefix (a guess at alice's prompt) hits nothing.
    bob = Request("bob-1", list(prompt), tenant="bob")
    assert kv.get_computed_blocks(bob) == ([], 0)
    assert _admit(kv, bob) == 0
    assert not set(bob.block_ids) & set(alice.block_ids)
    # The same tenant does hit its own blocks.
    again = Request("alice-2", list(prompt), tenant="alice")
    assert kv.get_computed_blocks(again) == (alice.block_ids[:3], 12)
    kv.check_integrity()


def test_global_prefix_cache_scope_shares_across_tenants() -> None:
    kv = KVCacheManager(32, 4, prefix_cache_scope="global")
    prompt = list(range(200, 213))
    alice = Request("alice-1", list(prompt), tenant="alice")
    _admit(kv, alice)
    assert kv.get_computed_blocks(Request("bob-1", list(prompt), tenant="bob"))[1] == 12
    with pytest.raises(ValueError, match="prefix_cache_scope"):
        KVCacheManager(8, 4, prefix_cache_scope="everyone")
