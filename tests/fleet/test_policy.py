"""Routing policy, version weights, retry budget, backoff and the health state machine."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batcher.fleet.health import HealthRecord
from batcher.fleet.rollout import Rollout
from batcher.fleet.policy import (
    Candidate,
    PolicyConfig,
    RetryBudget,
    affinity_key,
    backoff,
    choose,
    estimate_tokens,
    pick_version,
)

CFG = PolicyConfig()


def cand(rid: str, free: int, total: int = 1000, waiting: int = 0, version: str = "v1",
         fresh: bool = True) -> Candidate:
    return Candidate(rid, free, total, 16, waiting, version, fresh)


def test_estimate_tokens():
    assert estimate_tokens({"prompt": "x" * 400, "max_tokens": 50}, False, CFG) == 150
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 7}, False, CFG) == 10
    assert estimate_tokens({"prompt": ["x" * 40, "y" * 40], "n": 2}, False, CFG) == (
        20 + CFG.default_max_tokens) * 2
    chat = {"messages": [{"role": "user", "content": "x" * 80}], "max_tokens": 10}
    assert estimate_tokens(chat, True, CFG) == 20 + 4 + 10


def test_power_of_two_prefers_free_kv_after_reservation_and_fewer_waiting():
    rng = random.Random(0)
    a, b = cand("a", 900), cand("b", 100)
    assert all(choose([a, b], 64, None, CFG, rng).replica_id == "a" for _ in range(50))
    # Equal free blocks: the shorter queue wins.
    c, d = cand("c", 500, waiting=3), cand("d", 500, waiting=0)
    assert all(choose([c, d], 64, None, CFG, rng).replica_id == "d" for _ in range(50))
    # Different block sizes: compare what is left after this request's blocks.
    big = Candidate("big", 110, 1000, 64, 0, "v1")
    small = Candidate("small", 105, 1000, 1, 0, "v1")
    assert choose([big, small], 640, None, CFG, rng).replica_id == "big"


def test_spread_over_many_replicas_follows_free_kv():
    rng = random.Random(1)
    cands = [cand(f"r{i}", free) for i, free in enumerate((100, 400, 700, 1000))]
    picks = Counter(choose(cands, 16, None, CFG, rng).replica_id for _ in range(4000))
    assert picks["r3"] > picks["r2"] > picks["r1"] > picks["r0"] == 0


def test_fresh_replicas_are_preferred_over_suspect_ones():
    rng = random.Random(2)
    stale_but_empty, fresh = cand("s", 1000, fresh=False), cand("f", 10)
    assert all(choose([stale_but_empty, fresh], 16, None, CFG, rng).replica_id == "f"
               for _ in range(20))
    assert choose([stale_but_empty], 16, None, CFG, rng).replica_id == "s"


def test_prefix_affinity_is_stable_and_yields_when_hot():
    rng = random.Random(3)
    prompt = "You are a helpful assistant. " * 20
    key = affinity_key({"prompt": prompt + "question 1"}, False, CFG)
    assert key == affinity_key({"prompt": prompt + "question 2"}, False, CFG)
    assert affinity_key({"prompt": "short"}, False, CFG) is None
    cands = [cand(f"r{i}", 500) for i in range(4)]
    first = choose(cands, 16, key, CFG, rng).replica_id
    assert all(choose(cands, 16, key, CFG, rng).replica_id == first for _ in range(20))
    hot = [cand(c.replica_id, 50 if c.replica_id == first else 500) for c in cands]
    assert all(choose(hot, 16, key, CFG, rng).replica_id != first for _ in range(20))
    queued = [cand(c.replica_id, 500, waiting=int(c.replica_id == first)) for c in cands]
    assert choose(queued, 16, key, CFG, rng).replica_id != first


def test_exclude_never_returns_a_tried_replica():
    rng = random.Random(4)
    cands = [cand("a", 900), cand("b", 100)]
    assert choose(cands, 16, None, CFG, rng, exclude={"a"}).replica_id == "b"
    assert choose(cands, 16, None, CFG, rng, exclude={"a", "b"}) is None


def test_canary_at_five_percent_of_2000_picks():
    rng = random.Random(5)
    ro = Rollout()
    ro.canary("v2", 0.05)
    cands = [cand("a", 500), cand("b", 500), cand("c", 500, version="v2")]
    picks = Counter(choose(cands, 16, None, CFG, rng, ro.weights).version
                    for _ in range(2000))
    assert 0.03 <= picks["v2"] / 2000 <= 0.07, picks
    ro.promote("v2")
    assert {choose(cands, 16, None, CFG, rng, ro.weights).version for _ in range(50)} == {"v2"}
    ro.rollback("v2")
    assert {choose(cands, 16, None, CFG, rng, ro.weights).version for _ in range(50)} == {"v1"}


def test_pick_version_shares_the_rest_and_ignores_missing_versions():
    w = {"v2": 0.2, "*": 0.8}
    assert pick_version(w, {"v1", "v3"}, 0.99) in {"v1", "v3"}
    assert pick_version(w, {"v2"}, 0.99) == "v2"  # only the canary is there
    assert pick_version({"v2": 1.0}, {"v1"}, 0.5) is None
    assert pick_version({"v1": 0.0, "*": 1.0}, {"v1"}, 0.5) is None
    with pytest.raises(ValueError):
        Rollout().canary("v2", 1.5)
    with pytest.raises(ValueError):
        Rollout().set({"v1": -1})


def test_retry_budget_is_a_share_of_recent_requests_with_a_floor():
    b = RetryBudget(ratio=0.1, floor=3, window=10.0)
    assert [b.try_spend(0.0) for _ in range(4)] == [True, True, True, False]
    for i in range(100):
        b.note_request(1.0 + i * 0.01)
    spent = sum(b.try_spend(2.0) for _ in range(20))
    assert spent == 10 - 3  # 10% of 100, three already spent
    assert b.try_spend(2.0, inflight=200)  # in flight counts too
    b2 = RetryBudget(ratio=0.1, floor=3, window=10.0)
    for _ in range(100):
        b2.note_request(0.0)
    assert sum(b2.try_spend(0.0) for _ in range(50)) == 10
    assert sum(b2.try_spend(11.0) for _ in range(50)) == 3  # the window moved on


def test_full_jitter_backoff_bounds():
    assert backoff(0, 0.025, 0.5, 0.999) < 0.025
    assert backoff(10, 0.025, 0.5, 0.999) < 0.5
    assert backoff(3, 0.025, 0.5, 0.0) == 0.0


def test_health_record_evicts_after_failures_and_readmits_after_two_probes():
    probe_only = HealthRecord()
    for _ in range(2):
        assert not probe_only.fail("probe", 3, probe=True)
        probe_only.passed(False, 2)  # liveness passing does not clear probe failures
    assert probe_only.fail("probe", 3, probe=True) and probe_only.evicted
    rec = HealthRecord()
    assert not rec.fail("x", 3) and not rec.fail("x", 3)
    rec.passed(False, 2)  # a pass resets the failure count
    assert not rec.fail("x", 3) and not rec.fail("x", 3)
    assert rec.fail("x", 3) and rec.evicted and rec.evictions == 1
    assert not rec.passed(False, 2)  # liveness alone never re-admits
    assert not rec.passed(True, 2)
    rec.fail("again", 3)  # a failure restarts the count
    assert not rec.passed(True, 2)
    assert rec.passed(True, 2) and not rec.evicted and rec.readmitted_after == 2
    assert rec.evict("refused") and not rec.evict("refused")
