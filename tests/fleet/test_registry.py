"""Registry: newest (epoch, seq) wins, replays are ignored, staleness on the router's clock,
piggybacked state, reservations on top of stale data."""

from __future__ import annotations

import random

import pytest

from batcher.engine.snapshot import EngineSnapshot
from batcher.fleet.router.registry import BeatRefused, Registry, replica_id_for


def beat(rid: str = "a", epoch: int | str = 1, seq: int = 1, **state) -> dict:
    base = {"free_blocks": 100, "total_blocks": 100, "block_size": 16, "running": 0,
            "waiting": 0, "version": "v1", "draining": False, "healthy": True}
    return {**base, **state, "replica_id": rid, "url": f"http://{rid}:1", "epoch": epoch,
            "seq": seq}


def test_newest_beat_wins_and_replays_are_ignored():
    reg = Registry()
    assert reg.beat(beat(seq=1, free_blocks=90), now=0.0)
    assert reg.beat(beat(seq=3, free_blocks=70), now=1.0)
    assert not reg.beat(beat(seq=3, free_blocks=10), now=2.0)  # replay
    assert not reg.beat(beat(seq=2, free_blocks=10), now=2.0)  # older
    rep = reg.get("a")
    assert rep is not None and rep.state is not None
    assert rep.state.free_blocks == 70 and rep.seq == 3 and rep.beat_at == 1.0


def test_integer_epochs_are_ordered_and_string_epochs_retire():
    reg = Registry()
    assert reg.beat(beat(epoch=5, seq=40), 0.0)
    assert not reg.beat(beat(epoch=4, seq=99), 0.1)  # a beat from before the restart
    assert reg.beat(beat(epoch=6, seq=1), 0.2)  # the restart: seq starts again
    assert reg.get("a").seq == 1
    assert reg.beat(beat("b", epoch="x", seq=9), 0.0)
    assert reg.beat(beat("b", epoch="y", seq=1), 0.1)
    assert not reg.beat(beat("b", epoch="x", seq=10), 0.2)  # the old start, replayed


def test_malformed_beats_raise():
    reg = Registry()
    with pytest.raises(ValueError):
        reg.beat({"replica_id": "a", "url": "u", "epoch": 1, "seq": 1}, 0.0)  # no state
    with pytest.raises(ValueError):
        reg.beat(beat(seq="1"), 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reg.beat(beat(epoch=True), 0.0)


def test_suspect_after_three_missed_beats_on_the_router_clock():
    reg = Registry(beat_interval=1.0, suspect_beats=3)
    reg.beat(beat(), now=100.0)
    rep = reg.get("a")
    assert not reg.suspect(rep, 102.9)
    assert reg.suspect(rep, 103.1)
    # Piggybacked state refreshes capacity, never the beat clock.
    assert reg.observe("a", {**beat(), "free_blocks": 5}, now=103.0)
    assert rep.state.free_blocks == 5 and reg.suspect(rep, 103.2)


def test_static_replicas_are_kept_fresh_by_polls_until_they_beat():
    reg = Registry(beat_interval=1.0, suspect_beats=3)
    rep = reg.add_static("http://127.0.0.1:9000/")
    assert rep.replica_id == "127.0.0.1:9000" == replica_id_for(rep.url)
    assert reg.suspect(rep, 0.0) and not reg.routable(rep)  # no state yet
    assert reg.observe(rep.replica_id, beat(), now=10.0, poll=True)
    assert not reg.suspect(rep, 12.0) and reg.routable(rep)
    reg.beat(dict(beat(rep.replica_id), url=rep.url), now=11.0)  # polls stop counting now
    reg.observe(rep.replica_id, beat(), now=20.0, poll=True)
    assert rep.beat_at == 11.0 and reg.suspect(rep, 20.0)


def test_routable_needs_every_source_to_agree():
    reg = Registry()
    reg.beat(beat(), 0.0)
    rep = reg.get("a")
    # Registered by its own beat: not routable until a health round reached it.
    assert not rep.ready and not reg.routable(rep)
    rep.ready = True
    assert reg.routable(rep)
    for attr in ("evicted", "router_draining"):
        setattr(rep, attr, True)
        assert not reg.routable(rep)
        setattr(rep, attr, False)
    rep.ready = False
    assert not reg.routable(rep)
    rep.ready = True
    reg.beat(beat(seq=2, draining=True), 1.0)
    assert not reg.routable(rep)
    reg.beat(beat(seq=3, healthy=False), 2.0)
    assert not reg.routable(rep)


def test_reservations_count_only_until_a_newer_state_arrives():
    reg = Registry()
    reg.beat(beat(free_blocks=100, waiting=1), now=0.0)
    rep = reg.get("a")
    t1 = reg.reserve(rep, 10, now=0.5)
    reg.reserve(rep, 5, now=0.6)
    assert reg.effective_free(rep) == 85 and reg.effective_waiting(rep) == 3
    reg.beat(beat(seq=2, free_blocks=85), now=1.0)  # the replica now counts both itself
    assert reg.effective_free(rep) == 85 and reg.effective_waiting(rep) == 0
    reg.release(rep, t1)
    assert rep.inflight == 1


def test_the_unreflected_sums_kept_match_a_recount() -> None:
    """What a pick reads per replica is kept as reservations and states come and go; it must
    equal a recount of the reservations the last state cannot show."""
    rng = random.Random(7)
    reg = Registry()
    reg.beat(beat(), now=0.0)
    rep = reg.get("a")
    tokens: list[int] = []
    now, seq = 0.0, 1
    for _ in range(400):
        now += rng.choice((0.0, 0.01, 0.1))
        r = rng.random()
        if r < 0.45:
            tokens.append(reg.reserve(rep, rng.randint(1, 9), now))
        elif r < 0.8 and tokens:
            reg.release(rep, tokens.pop(rng.randrange(len(tokens))))
        elif r < 0.9:
            seq += 1
            reg.beat(beat(seq=seq), now=now)
        else:
            reg.observe("a", beat(), now)
        mine = rep.unreflected()
        assert rep.unreflected_count == len(mine)
        assert rep.unreflected_blocks == sum(x.blocks for x in mine)


def test_forget_only_evicted_silent_dynamic_replicas():
    reg = Registry(forget_after=60.0)
    reg.beat(beat("dyn"), 0.0)
    reg.add_static("http://s:1")
    reg.get("s:1").evicted = True
    reg.get("dyn").evicted = True
    assert reg.forget_stale(30.0) == []
    assert reg.forget_stale(61.0) == ["dyn"]
    assert reg.get("s:1") is not None


def test_state_parse_rejects_missing_fields():
    with pytest.raises(ValueError):
        EngineSnapshot.from_wire({"free_blocks": 1})


def test_a_live_replica_cannot_be_repointed():
    reg = Registry(beat_interval=1.0, suspect_beats=3)
    assert reg.beat(beat("a", epoch=5, seq=1), 0.0)
    for hijack in (dict(beat("a", epoch=5, seq=2), url="http://evil:1"),  # same start
                   dict(beat("a", epoch=6, seq=1), url="http://evil:1"),  # "a restart"
                   dict(beat("a", epoch="x", seq=1), url="http://evil:1")):
        with pytest.raises(BeatRefused) as err:
            reg.beat(hijack, 1.0)
        assert err.value.status == 409
    rep = reg.get("a")
    assert rep.url == "http://a:1" and rep.epoch == 5 and rep.seq == 1
    # The real replica keeps beating as before.
    assert reg.beat(beat("a", epoch=5, seq=2), 2.0) and rep.url == "http://a:1"
    # Once it stopped beating (suspect), a new start may come back at a new address.
    moved = dict(beat("a", epoch=7, seq=1), url="http://a2:1")
    with pytest.raises(BeatRefused):
        reg.beat(moved, 4.9)
    rep.ready = True
    assert reg.beat(moved, 5.1) and rep.url == "http://a2:1"
    assert not rep.ready  # the new address is not reached yet
    # ... but never the same start at another address.
    with pytest.raises(BeatRefused):
        reg.beat(dict(beat("a", epoch=7, seq=2), url="http://a3:1"), 99.0)


def test_configured_replicas_keep_their_address():
    reg = Registry()
    rep = reg.add_static("http://10.0.0.1:8000", "r0", "http://10.0.0.1:9000")
    with pytest.raises(BeatRefused):
        reg.beat(dict(beat("r0"), url="http://evil:1"), 1000.0)
    assert reg.beat(dict(beat("r0"), url="http://10.0.0.1:8000",
                         admin_url="http://evil:2"), 1000.0, trusted=True)
    assert rep.url == "http://10.0.0.1:8000" and rep.admin_url == "http://10.0.0.1:9000"


def test_admin_urls_only_from_trusted_beats():
    reg = Registry()
    reg.beat(dict(beat("a"), admin_url="http://evil:2"), 0.0)
    assert reg.get("a").admin_url is None
    reg.beat(dict(beat("a", seq=2), admin_url="http://a:2"), 0.1, trusted=True)
    assert reg.get("a").admin_url == "http://a:2"


def test_replica_count_is_capped_and_known_replicas_stay():
    reg = Registry(max_replicas=3)
    for i in range(3):
        assert reg.beat(beat(f"r{i}"), 0.0)
    with pytest.raises(BeatRefused) as err:
        reg.beat(beat("flood"), 0.1)
    assert err.value.status == 503 and len(reg) == 3 and reg.get("flood") is None
    assert reg.beat(beat("r0", seq=2), 0.2)  # known replicas keep beating


@pytest.mark.parametrize("kind", ["router", "balancer"])
def test_forgotten_replicas_leave_no_metric_series(kind: str) -> None:
    """A flood of 300 registrations, each evicted after some traffic and then forgotten: the
    router's (and a balancer's) /metrics keep no series labelled with any of them."""
    from batcher.fleet.balancer.app import BalancerContext
    from batcher.fleet.router.context import RouterConfig, RouterContext

    ctx = (RouterContext(RouterConfig(max_replicas=400)) if kind == "router"
           else BalancerContext(RouterConfig(max_replicas=400)))
    reg = ctx.registry
    reg.beat(beat("keep"), 0.0, trusted=True)
    reg.observe("keep", beat("keep"), 0.0)
    for i in range(300):
        rid = f"flood-{i}"
        reg.beat(beat(rid), 0.0, trusted=True)
        reg.observe(rid, beat(rid), 0.0)  # as a poll or piggyback (a balancer keeps figures)
        rep = reg.get(rid)
        assert rep is not None
        ctx.metrics.attempt(rid, "v1", "ok")
        ctx.metrics.attempt(rid, None, "error")
        rep.evicted = True
        ctx.on_evict(rep, "flood")
        ctx.on_readmit(rep)
        rep.evicted = True
    ctx.metrics.attempt("keep", "v1", "ok")
    before = ctx.metrics.exposition().decode()
    assert 'replica="flood-299"' in before
    assert len(reg.forget_stale(reg.forget_after + 1.0)) == 300
    after = ctx.metrics.exposition().decode()
    assert "flood-" not in after
    assert 'replica="keep"' in after  # a replica still known keeps its series
    if kind == "balancer":
        assert set(reg.figures) == {"keep"}  # type: ignore[attr-defined]
