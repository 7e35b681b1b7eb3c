"""Routing policy, version weights, retry budget, backoff and the health state machine."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from batcher.fleet.router.health import HealthRecord
from batcher.fleet.router.policy import (
    Candidate,
    PolicyConfig,
    Priors,
    choose,
    pick_version,
    predicted_wait,
    rendezvous_weight,
)
from batcher.fleet.router.request_estimates import (
    affinity_key,
    estimate_prompt_tokens,
    estimate_tokens,
)
from batcher.fleet.router.retry_budget import RetryBudget, backoff
from batcher.fleet.router.rollout import Rollout

CFG = PolicyConfig()


def cand(rid: str, free: int = 900, total: int = 1000, waiting: int = 0, version: str = "v1",
         fresh: bool = True, **kw: object) -> Candidate:
    return Candidate(rid, free, total, 16, waiting, version, fresh, **kw)


def test_estimate_tokens():
    assert estimate_tokens({"prompt": "x" * 400, "max_tokens": 50}, False, CFG) == 150
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 7}, False, CFG) == 10
    assert estimate_tokens({"prompt": ["x" * 40, "y" * 40], "n": 2}, False, CFG) == (
        20 + CFG.default_max_tokens) * 2
    chat = {"messages": [{"role": "user", "content": "x" * 80}], "max_tokens": 10}
    assert estimate_tokens(chat, True, CFG) == 20 + 4 + 10
    assert estimate_prompt_tokens({"prompt": "x" * 400, "max_tokens": 50}, False, CFG) == 100
    assert estimate_prompt_tokens(chat, True, CFG) == 24
    assert estimate_prompt_tokens({"prompt": "x" * 40, "n": 3}, False, CFG) == 10


def picks(cands: list[Candidate], n: int = 200, tokens: int = 64, prompt: int = 48,
          seed: int = 0) -> Counter:
    rng = random.Random(seed)
    return Counter(choose(cands, tokens, None, CFG, rng, prompt_tokens=prompt).replica_id
                   for _ in range(n))


def test_abundant_kv_does_not_decide_the_prefill_queue_does():
    # Free KV differs a lot but is plentiful on both: the replica with prompt tokens queued
    # ahead is the slower one to a first token, whatever its free blocks say.
    busy_empty_kv = cand("a", free=990, prefill_tokens=4000)
    idle_fuller_kv = cand("b", free=300)
    assert picks([busy_empty_kv, idle_fuller_kv]) == {"b": 200}
    # What the replica reports beyond the router's own requests (other routers' work) counts.
    assert picks([cand("c", waiting=5, others=5), cand("d", waiting=5)]) == {"d": 200}


def test_measured_rates_make_a_slow_replica_take_less_work():
    fast = cand("fast", prefill_rate=4000.0, step_s=0.02, prefill_tokens=1000, inflight=3)
    slow = cand("slow", prefill_rate=1000.0, step_s=0.08, prefill_tokens=400, inflight=2)
    assert picks([fast, slow]) == {"fast": 200}  # 0.36 s + 0.02 s vs 0.56 s + 0.08 s
    idle_slow = cand("slow", prefill_rate=1000.0, step_s=0.08)
    assert picks([fast, idle_slow]) == {"slow": 200}
    # Unmeasured replicas are assumed to be like the fleet's measured mean, not the default.
    w_new = predicted_wait(cand("new"), 100, 116, CFG, Priors.of([fast, slow, cand("n")], CFG))
    assert w_new == pytest.approx(100 / 2500.0 + 0.05)


def test_a_stalled_replica_is_avoided_before_any_heartbeat_says_so():
    stalled = cand("s", prefill_tokens=100, overdue_s=4.0, inflight=1)
    assert picks([stalled, cand("ok", prefill_tokens=2000, inflight=10)]) == {"ok": 200}


def test_kv_is_a_fit_constraint_and_a_score_only_when_scarce():
    # The request needs 8 blocks: a replica with 5 free cannot hold it.
    assert picks([cand("full", free=5), cand("busy", prefill_tokens=3000)], tokens=128) == {
        "busy": 200}
    # Nobody can hold it: still routed (the replica's final check answers), not dropped.
    assert sum(picks([cand("x", free=5), cand("y", free=6)], tokens=128).values()) == 200
    # Scarce (below the headroom after this request) costs wait; plentiful does not.
    priors = Priors(CFG.prefill_rate_prior, CFG.step_s_prior)
    scarce = predicted_wait(cand("a", free=60), 48, 64, CFG, priors)
    plenty = predicted_wait(cand("b", free=500), 48, 64, CFG, priors)
    plenty2 = predicted_wait(cand("c", free=900), 48, 64, CFG, priors)
    assert scarce > plenty == plenty2


def test_a_request_late_everywhere_is_packed_where_it_costs_in_time_requests_nothing():
    # 2,000-token prompts at 2,000 tokens/s: 1 s of prefill on an idle fast replica, 2 s on a
    # half-speed one; the objective is 1 s, so this request misses it everywhere.
    fast = cand("fast", prefill_rate=2000.0, step_s=0.02, prefill_tokens=400)
    slow_idle = cand("slow-idle", prefill_rate=1000.0, step_s=0.04)
    slow_busy = cand("slow-busy", prefill_rate=1000.0, step_s=0.04, prefill_tokens=1000,
                     inflight=2)
    # The least wait would be the fast replica (1.2 s + a step); the request goes to the
    # busiest replica where it could never make 1 s anyway, keeping the fast one short.
    assert picks([fast, slow_idle, slow_busy], tokens=2040, prompt=2000) == {"slow-busy": 200}
    # ...but never more than late_extra_s above the least wait,
    tight = PolicyConfig(late_extra_s=1.0).validate()  # 2.2 s: slow-idle's 2.04 s, not 3.8
    rng = random.Random(0)
    assert choose([fast, slow_idle, slow_busy], 2040, None, tight, rng,
                  prompt_tokens=2000).replica_id == "slow-idle"
    # nor onto a replica late on what it already has (how late it will be is unknown),
    stalled = cand("slow-busy", prefill_rate=1000.0, step_s=0.04, prefill_tokens=1000,
                   inflight=2, overdue_s=0.1)
    assert picks([fast, slow_idle, stalled], tokens=2040, prompt=2000) == {"slow-idle": 200}
    # and a request that can still meet the objective takes the least wait (0.24 s on the
    # idle half-speed replica against 0.32 s behind the fast one's queue).
    assert picks([fast, slow_idle, slow_busy], tokens=240, prompt=200) == {"slow-idle": 200}
    # Without an objective the least predicted wait always wins.
    off = PolicyConfig(slo_ttft_s=0).validate()
    assert choose([fast, slow_idle, slow_busy], 2040, None, off, rng,
                  prompt_tokens=2000).replica_id == "fast"


def test_rendezvous_ranking_is_stable_and_spreads_keys():
    ids = [f"10.0.0.{i}:8000" for i in range(16)]
    owners = Counter(max(ids, key=lambda r: rendezvous_weight(f"prompt {k}", r))
                     for k in range(1600))
    assert len(owners) == 16 and max(owners.values()) < 2 * 1600 / 16
    # Removing a replica moves only the keys it owned.
    rest = ids[1:]
    for k in range(200):
        before = max(ids, key=lambda r: rendezvous_weight(f"prompt {k}", r))
        after = max(rest, key=lambda r: rendezvous_weight(f"prompt {k}", r))
        assert before == ids[0] or before == after
    assert rendezvous_weight("k", "r") == rendezvous_weight("k", "r") != rendezvous_weight(
        "k", "s")


def test_ties_spread_at_random_and_prefer_free_kv():
    even = picks([cand(f"r{i}") for i in range(4)], n=400)
    assert set(even) == {"r0", "r1", "r2", "r3"} and min(even.values()) > 60
    assert picks([cand("a", free=800), cand("b", free=900)]) == {"b": 200}


def test_fresh_replicas_are_preferred_over_suspect_ones():
    rng = random.Random(2)
    stale_but_empty, fresh = cand("s", 1000, fresh=False), cand("f", 100, prefill_tokens=900)
    assert all(choose([stale_but_empty, fresh], 16, None, CFG, rng).replica_id == "f"
               for _ in range(20))
    assert choose([stale_but_empty], 16, None, CFG, rng).replica_id == "s"


def test_prefix_affinity_is_stable_and_costs_at_most_a_bounded_wait():
    rng = random.Random(3)
    prompt = "You are a helpful assistant. " * 20
    key = affinity_key({"prompt": prompt + "question 1"}, False, CFG)
    assert key == affinity_key({"prompt": prompt + "question 2"}, False, CFG)
    assert affinity_key({"prompt": "short"}, False, CFG) is None
    cands = [cand(f"r{i}") for i in range(4)]
    first = choose(cands, 16, key, CFG, rng).replica_id
    assert all(choose(cands, 16, key, CFG, rng).replica_id == first for _ in range(20))
    # A little work queued on the preferred replica (within the bound) keeps the cache hit...
    rate = CFG.prefill_rate_prior
    small = int(0.5 * CFG.affinity_max_extra_s * rate)
    near = [cand(c.replica_id, prefill_tokens=small if c.replica_id == first else 0)
            for c in cands]
    assert all(choose(near, 16, key, CFG, rng).replica_id == first for _ in range(20))
    # ...more than the bound sends the request elsewhere.
    big = int(2 * CFG.affinity_max_extra_s * rate)
    far = [cand(c.replica_id, prefill_tokens=big if c.replica_id == first else 0)
           for c in cands]
    assert all(choose(far, 16, key, CFG, rng).replica_id != first for _ in range(20))
    full = [cand(c.replica_id, free=1 if c.replica_id == first else 900) for c in cands]
    assert choose(full, 64, key, CFG, rng).replica_id != first


def test_sampling_a_subset_still_scores_the_preferred_replica():
    cfg = PolicyConfig(choices=2, sample_above=0).validate()
    rng = random.Random(6)
    cands = [cand(f"r{i}", prefill_tokens=100 * i) for i in range(16)]
    got = Counter(choose(cands, 16, None, cfg, rng).replica_id for _ in range(400))
    assert len(got) > 4 and got["r0"] > got["r15"] == 0  # the worse of a pair never wins
    key = "k" * 100
    pref = max(cands, key=lambda c: rendezvous_weight(key, c.replica_id)).replica_id
    idle = [cand(c.replica_id) for c in cands]
    assert {choose(idle, 16, key, cfg, rng).replica_id for _ in range(50)} == {pref}
    with pytest.raises(ValueError):
        PolicyConfig(choices=1).validate()


def test_exclude_never_returns_a_tried_replica():
    rng = random.Random(4)
    cands = [cand("a", 900), cand("b", 100, prefill_tokens=5000)]
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


def test_a_responses_body_is_estimated_as_its_chat_equivalent():
    from aiohttp.test_utils import make_mocked_request

    from batcher.fleet.router.context import RouterConfig, RouterContext
    from batcher.fleet.router.forward import Relay

    long = "You are a careful assistant. " * 40
    chat = {"messages": [{"role": "system", "content": long},
                         {"role": "user", "content": "x" * 400}], "max_tokens": 30}
    resp = {"instructions": long, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x" * 400}]}],
        "max_output_tokens": 30}
    ctx = RouterContext(RouterConfig())

    def relay(path: str, body: dict) -> Relay:
        return Relay(ctx, make_mocked_request("POST", path), True, body, b"", "rid", "scope")

    want, got = relay("/v1/chat/completions", chat), relay("/v1/responses", resp)
    assert (got.tokens, got.prompt_tokens) == (want.tokens, want.prompt_tokens)
    assert got.prompt_tokens > 100 and got.key is not None and got.key == want.key
    plain = relay("/v1/responses", {"input": "y" * 400})
    assert plain.prompt_tokens == estimate_prompt_tokens(
        {"messages": [{"role": "user", "content": "y" * 400}]}, True, CFG)
    # A shape the estimates cannot read goes on as it is (the replica's 400 names the field).
    odd = relay("/v1/responses", {"input": 7})
    assert odd.prompt_tokens == 1 and odd.key is None
