"""The router's own load account per replica, round-robin for comparison, and the fake model's
step-time factor."""

from __future__ import annotations

import random

import orjson
import pytest

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.engine.fake_runner import FakeRunner, FakeSpeed
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.load import EWMA_ALPHA, SAMPLE_CLAMP, STALL_STEPS, ReplicaLoad
from batcher.fleet.router.policy import Candidate, choose_round_robin
from batcher.core.sampling import SamplingParams


def test_prefill_tokens_rate_and_step_follow_the_attempts() -> None:
    load = ReplicaLoad(seqs_per_step=8.0)
    load.sent("a", 1000, now=0.0)
    load.sent("b", 500, now=0.1)  # one sequence in flight there already: slowdown 1 + 1/8
    assert (load.inflight, load.prefill_tokens) == (2, 1500)
    assert load.overdue_s(2.0) == 0.0  # nothing measured yet: nothing is late
    load.token("a", now=0.5)  # a's first token: 1000 tokens in 0.5 s
    assert load.prefill_tokens == 500 and load.prefill_rate == pytest.approx(2000.0)
    # b expected (1000 ahead + 500) x 1.125 / 2000 = 0.84 s after 0.1: late by 2.0 - 0.94
    assert load.overdue_s(2.0) == pytest.approx(2.0 - 0.1 - 0.84375)
    load.token("b", now=1.1)  # 1500 x 1.125 tokens' worth in 1.0 s
    assert load.prefill_rate == pytest.approx(2000.0 + EWMA_ALPHA * (1687.5 - 2000.0))
    for i in range(1, 11):
        load.token("a", now=0.5 + 0.05 * i)
    load.done("a")
    assert load.step_s == pytest.approx(0.05) and load.inflight == 1
    # b's stream then goes quiet: late once it misses STALL_STEPS steps
    assert load.overdue_s(1.1 + STALL_STEPS * 0.05) == pytest.approx(0.0, abs=1e-9)
    assert load.overdue_s(3.0) == pytest.approx(3.0 - 1.1 - STALL_STEPS * 0.05)
    load.done("b")  # one token after the first: no step measured from it
    assert load.step_s == pytest.approx(0.05)
    assert (load.inflight, load.prefill_tokens, load.overdue_s(9.0)) == (0, 0, 0.0)


def test_one_stalled_sample_moves_the_rate_one_bounded_step() -> None:
    load = ReplicaLoad()
    load.sent(1, 1000, now=0.0)
    load.token(1, now=0.5)
    load.sent(2, 1000, now=1.0)
    load.token(2, now=11.0)  # a 10 s stall: the raw sample is 100 tokens/s
    low = 2000.0 / SAMPLE_CLAMP
    assert load.prefill_rate == pytest.approx(2000.0 + EWMA_ALPHA * (low - 2000.0))


def test_an_attempt_that_ends_before_its_first_token_leaves_no_trace() -> None:
    load = ReplicaLoad()
    load.sent(1, 300, now=0.0)
    load.done(1)
    assert (load.inflight, load.prefill_tokens, load.prefill_rate) == (0, 0, None)
    load.token(1, now=1.0)  # a late chunk of an ended attempt changes nothing
    assert load.prefill_rate is None and not load.started


def test_others_is_what_a_report_shows_beyond_the_routers_own_requests() -> None:
    load = ReplicaLoad()
    load.sent("a", 10, now=0.0)
    load.sent("b", 10, now=0.5)
    load.state_seen(1.0)  # measured with a and b running, plus 3 of another router
    assert load.others(running=5, waiting=0) == 3
    load.done("a")  # the report still counts a: not another router's
    load.sent("c", 10, now=1.5)  # sent after the report: the report cannot show it
    assert load.others(running=5, waiting=0) == 3
    load.state_seen(2.0)  # b and c running, nothing else
    assert load.others(running=2, waiting=0) == 0
    load.state_seen(1.5)  # an older report changes nothing
    assert load.others(running=2, waiting=0) == 0


def test_round_robin_cycles_in_id_order_and_skips_tried() -> None:
    cands = [Candidate(rid, 100, 100, 16, 0, "v1") for rid in ("r2", "r0", "r1")]
    rng = random.Random(0)
    assert [choose_round_robin(cands, t, rng).replica_id for t in range(4)] == [
        "r0", "r1", "r2", "r0"]
    assert choose_round_robin(cands, 0, rng, exclude={"r0"}).replica_id == "r1"
    assert choose_round_robin(cands, 0, rng, exclude={"r0", "r1", "r2"}) is None
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(routing="least-connections").validate()


def test_the_fake_models_step_factor_slows_every_step() -> None:
    seq = ScheduledSeq("x", list(range(100)), 0, [0] * 7, True, SamplingParams())
    sched = SchedulerOutput([seq])
    base = FakeRunner(64, 16, 1000).step_seconds(sched)
    slow = FakeRunner(64, 16, 1000, FakeSpeed(step_factor=2.0)).step_seconds(sched)
    assert slow == pytest.approx(2 * base) and base > 0
    with pytest.raises(ValueError, match="step factor"):
        FakeRunner(64, 16, 1000, FakeSpeed(step_factor=0.0))


def _router(routing: str = "predicted-wait") -> RouterContext:
    ctx = RouterContext(RouterConfig(routing=routing), clock=lambda: 100.0,
                        rng=random.Random(0))
    for rid in ("a", "b"):
        ctx.registry.beat({"replica_id": rid, "url": f"http://127.0.0.1:1/{rid}", "epoch": 1,
                           "seq": 1, "free_blocks": 1000, "total_blocks": 1000,
                           "block_size": 16, "running": 0, "waiting": 0, "version": "v1",
                           "draining": False, "healthy": True}, 100.0)
        ctx.registry.get(rid).ready = True  # as a health round that reached it sets
    return ctx


def test_the_router_routes_on_its_own_account_until_replicas_report() -> None:
    ctx = _router()
    a = ctx.registry.get("a")
    attempts = [ctx.begin(a, 600, stream=True, prompt_tokens=500) for _ in range(3)]
    # Heartbeats still say both are idle; the router knows "a" has 1,500 prompt tokens queued.
    assert {ctx.pick(600, None, set(), 500).replica_id for _ in range(20)} == {"b"}
    for att in attempts:
        ctx.progress(att, 100.0)
        ctx.end(att)
    assert ctx.loads["a"].inflight == 0 and ctx.loads["a"].prefill_tokens == 0
    assert {ctx.pick(600, None, set(), 500).replica_id for _ in range(40)} == {"a", "b"}


def test_round_robin_routing_ignores_load() -> None:
    ctx = _router("round-robin")
    ctx.begin(ctx.registry.get("a"), 600, prompt_tokens=500)
    assert [ctx.pick(600, None, set(), 500).replica_id for _ in range(4)] == ["a", "b", "a", "b"]


def test_kv_since_follows_the_routers_own_streams_between_reports() -> None:
    load = ReplicaLoad()
    load.sent("a", 100, now=0.0)
    load.token("a", now=0.2)
    load.state_seen(0.3)  # the report holds a: 100 prompt + 1 token
    assert load.kv_since == 0
    load.sent("b", 50, now=0.4)  # sent after the report: the registry reserves its blocks
    load.token("a", now=0.5, count=9)  # a grew 9 tokens the report does not show
    load.token("b", now=0.6, count=3)  # b's growth is in its reservation, not here
    assert load.kv_since == 9
    load.done("a")  # the report counted a: all it held (100 + 10) is free now
    assert load.kv_since == 9 - 110
    load.done("b")
    assert load.kv_since == 9 - 110
    load.state_seen(1.0)  # a new report shows all of it
    assert load.kv_since == 0
    load.sent("c", 20, now=1.1)
    load.state_seen(1.2)  # c was pending when measured: its first tokens are growth
    load.token("c", now=1.3, count=2)
    assert load.kv_since == 2


def test_candidates_free_blocks_follow_the_routers_own_streams() -> None:
    ctx = _router()  # both report 1,000 of 1,000 blocks free (16 tokens each), measured at 100
    a = ctx.registry.get("a")
    ctx.clock = lambda: 99.0
    att = ctx.begin(a, 64 * 16, stream=True, prompt_tokens=32 * 16)  # sent before the report
    ctx.clock = lambda: 100.0
    assert ctx.candidates(100.0)[0].free_blocks == 1000  # the report shows it already
    for _ in range(16 * 4):  # its stream grows 4 blocks the report does not show
        ctx.progress(att, 100.5)
    assert ctx.candidates(100.5)[0].free_blocks == 1000 - 4
    ctx.end(att)  # it ended: what it held (32 + 4 blocks) is free, up to the pool's size
    assert ctx.candidates(100.6)[0].free_blocks == 1000


def test_prefill_ahead_is_capped_by_what_the_report_shows_unserved() -> None:
    load = ReplicaLoad()
    assert load.prefill_ahead(500) == 0  # nothing of the router's own waits there
    load.sent("a", 1000, now=0.0)
    load.sent("b", 400, now=0.1)
    load.state_seen(0.2)  # measured with 300 prompt tokens still unserved: a is mostly read
    load.sent("c", 200, now=0.3)  # after the report: counted whole
    assert load.prefill_tokens == 1600
    assert load.prefill_ahead(300) == 300 + 200
    assert load.prefill_ahead(5000) == 1600  # never more than the router's own count
    load.token("a", now=0.4)
    load.token("b", now=0.5)
    assert load.prefill_ahead(300) == 200


def test_the_prompt_tokens_sent_since_a_report_match_a_recount() -> None:
    rng = random.Random(11)
    load = ReplicaLoad()
    live: list[int] = []
    now = 0.0
    for key in range(500):
        now += rng.choice((0.0, 0.01, 0.1))
        r = rng.random()
        if r < 0.4:
            load.sent(key, rng.randint(1, 500), now)
            live.append(key)
        elif r < 0.6 and live:
            load.token(rng.choice(live), now)
        elif r < 0.85 and live:
            load.done(live.pop(rng.randrange(len(live))))
        else:
            load.state_seen(now - rng.choice((0.0, 0.05)))
        assert load.prompt_since == sum(p.prompt for p in load.pending.values()
                                        if p.sent >= load.state_at)



@pytest.mark.parametrize("stream", [True, False])
async def test_the_state_on_an_answer_is_read_as_of_when_it_was_taken(aiohttp_client,
                                                                      stream: bool) -> None:
    """A stream's state is taken as its first event leaves and still counts it; a whole
    answer's is taken after it left the scheduler. Either way, once the router's requests have
    ended, what the replica reports beyond them is other routers' work: here one sequence."""
    from aiohttp import web

    from batcher.fleet.router.proxy import create_router_app

    def state(running: int) -> str:
        return orjson.dumps({"free_blocks": 90, "total_blocks": 100, "block_size": 16,
                             "running": running, "waiting": 0, "version": "v1",
                             "draining": False, "healthy": True}).decode()

    async def complete(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):  # another router's sequence runs there
            return web.json_response({"choices": [{"text": "x"}]},
                                     headers={"X-Replica-State": state(1)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Replica-State": state(2)})  # it, and the other
        await resp.prepare(request)
        for text in ("a", "b"):
            await resp.write(b"data: " + orjson.dumps({"choices": [
                {"index": 0, "text": text, "finish_reason": None}]}) + b"\n\n")
        await resp.write(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}'
                         b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", complete)
    replica = await aiohttp_client(upstream)
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(replica.make_url("")).rstrip("/"))
    assert ctx.registry.observe(rep.replica_id, orjson.loads(state(1)), ctx.clock(), poll=True)
    router = await aiohttp_client(create_router_app(ctx))
    for _ in range(3):
        resp = await router.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                          "stream": stream})
        assert resp.status == 200, await resp.text()
        await resp.read()
    (cand,) = ctx.candidates(ctx.clock())
    assert (cand.inflight, cand.others) == (0, 1)
