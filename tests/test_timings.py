"""Latency anatomy: phases that add up, re-queueing after preemption counted as queue, the
`Server-Timing` header and `timings` object on answers, phase and step-kind histograms, and one
access line per request that never carries the prompt."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batcher.telemetry.access_log import JsonFormatter
from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.engine.fake_runner import FakeRunner, FakeSpeed
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.telemetry.timings import PHASES, EngineTimes, PhaseClock, Timings, split
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory, auth, completion


def marks_at(received: float, parsed: float | None, tokenized: float | None) -> PhaseClock:
    m = PhaseClock(clock=lambda: 0.0, received=received)
    m.parsed, m.tokenized = parsed, tokenized
    return m


def test_phases_are_the_gaps_between_marks_and_add_up() -> None:
    eng = EngineTimes(first_scheduled=1.0, first_token=1.5, last_token=3.0, finished=3.0)
    t = split(marks_at(0.0, 0.01, 0.05), eng, 3.2)
    assert [round(getattr(t, p + "_ms"), 6) for p in PHASES] == [10, 40, 950, 500, 1500, 200]
    assert t.total_ms == pytest.approx(3200)
    assert t.bottleneck == "decode"
    assert "decode;dur=1500.000" in t.server_timing()
    assert t.server_timing().endswith("total;dur=3200.000")


def test_requeue_after_preemption_moves_into_queue_and_total_is_kept() -> None:
    eng = EngineTimes(first_scheduled=1.0, first_token=1.5, last_token=3.0, finished=3.0,
                      requeue_before_first_token=0.2, requeue_after_first_token=1.0,
                      preemptions=2)
    t = split(marks_at(0.0, 0.01, 0.05), eng, 3.2)
    assert t.queue_ms == pytest.approx(950 + 200 + 1000)
    assert t.prefill_ms == pytest.approx(300)
    assert t.decode_ms == pytest.approx(500)
    assert sum(t.phases().values()) == pytest.approx(t.total_ms)
    assert t.preemptions == 2 and t.bottleneck == "queue"


def test_a_request_that_ends_early_spends_the_rest_in_its_phase() -> None:
    bad_json = split(marks_at(0.0, None, None), None, 0.004)
    assert bad_json.parse_ms == pytest.approx(4) and bad_json.bottleneck == "parse"
    refused = split(marks_at(0.0, 0.001, 0.002), None, 0.5)
    assert refused.queue_ms == pytest.approx(498) and refused.post_ms == 0
    assert sum(refused.phases().values()) == pytest.approx(refused.total_ms)


def test_timings_round_trip_and_router_share() -> None:
    t = split(marks_at(0.0, 0.001, 0.002), EngineTimes(0.01, 0.02, 0.05, 0.05), 0.06)
    back = Timings.from_json(orjson.loads(orjson.dumps(t.to_json())))
    assert back is not None and back.total_ms == pytest.approx(t.total_ms, abs=1e-3)
    routed = back.through_router(t.total_ms + 7.0)
    assert routed.route_ms == pytest.approx(7.0, abs=1e-3)
    assert routed.server_timing().startswith("route;dur=7.0")
    assert Timings.from_json({"parse_ms": "x"}) is None


async def test_engine_times_count_requeue_after_preemption(tokenizer) -> None:
    # 6 blocks of 16 tokens cannot hold 4 sequences of 40 + 40 tokens: some are preempted.
    runner = FakeRunner(6, 16, tokenizer.vocab_size, FakeSpeed(decode_step_s=0.002))
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=4,
                         max_num_batched_tokens=256, max_model_len=256), debug_checks=True)
    await engine.start()
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    finals = []

    async def one(i: int) -> None:
        async for ev in engine.generate(Request(f"r{i}", [300 + i] * 40, sp)):
            if ev.finished:
                finals.append(ev)

    await asyncio.gather(*(one(i) for i in range(4)))
    await engine.stop()
    preempted = [ev for ev in finals if ev.times.preemptions]
    assert preempted, "the setup must preempt"
    for ev in preempted:
        times = ev.times
        assert times.requeue_before_first_token + times.requeue_after_first_token > 0
        marks = marks_at(times.first_scheduled - 0.002, times.first_scheduled - 0.001,
                         times.first_scheduled)
        t = split(marks, times, times.finished)
        assert t.queue_ms >= 1000 * (times.requeue_before_first_token
                                     + times.requeue_after_first_token) - 1e-6
        assert sum(t.phases().values()) == pytest.approx(t.total_ms)


@pytest.fixture
def tokenizer():
    from batcher.tokenizer.tokenizer import load_tokenizer
    return load_tokenizer()


def samples(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.serial  # the client's time and the server's agree within 50 ms
async def test_answers_carry_phases_that_add_up(aiohttp_client, tiny_fp32, tokenizer, caplog
                                                ) -> None:
    client = await aiohttp_client(app_factory(tiny_fp32, tokenizer, TENANTS)())
    caplog.set_level(logging.INFO, logger="batcher.access")
    secret = "the quick secret prompt"
    sent = time.monotonic()
    r = await client.post("/v1/completions", json=completion(prompt=secret, max_tokens=6),
                          headers=auth(ALICE) | {"X-Request-Id": "anat-1"})
    body = await r.json()
    client_ms = (time.monotonic() - sent) * 1000
    assert r.status == 200
    t = body["timings"]
    phases = [t[p + "_ms"] for p in PHASES]
    assert all(v >= 0 for v in phases)
    assert abs(sum(phases) - t["total_ms"]) < 0.01  # rounding of six values only
    assert t["total_ms"] <= client_ms + 1.0 and client_ms - t["total_ms"] < 50
    assert t["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert t["completion_tokens"] == 6 and t["preemptions"] == 0
    assert t["bottleneck"] in PHASES and t[t["bottleneck"] + "_ms"] == max(phases)
    header = dict(part.split(";dur=") for part in r.headers["Server-Timing"].split(", "))
    assert list(header) == [*PHASES, "total"]
    assert float(header["total"]) == pytest.approx(t["total_ms"], abs=1e-3)
    # One access line for the request, with its phases, never its prompt.
    lines = [rec for rec in caplog.records if rec.name == "batcher.access"]
    assert len(lines) == 1
    assert "request_id=anat-1" in lines[0].getMessage()
    assert "tenant=alice" in lines[0].getMessage() and "status=200" in lines[0].getMessage()
    assert secret not in lines[0].getMessage() and ALICE not in lines[0].getMessage()
    as_json = json.loads(JsonFormatter().format(lines[0]))
    assert as_json["request_id"] == "anat-1" and as_json["finish_reason"] == "length"
    assert as_json["decode_ms"] == t["decode_ms"]

    # A stream with include_usage: timings on the usage chunk.
    r = await client.post("/v1/completions", json=completion(
        max_tokens=5, stream=True, stream_options={"include_usage": True}), headers=auth(ALICE))
    chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines()
              if line.startswith("data: {")]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    st = usage_chunk["timings"]
    assert abs(sum(st[p + "_ms"] for p in PHASES) - st["total_ms"]) < 0.01
    assert st["decode_ms"] > 0 and st["completion_tokens"] == 5

    # A bad request: logged with its status, no phase histograms.
    r = await client.post("/v1/completions", data=b"{", headers=auth(ALICE))
    assert r.status == 400
    assert any("status=400" in rec.getMessage() for rec in caplog.records
               if rec.name == "batcher.access")

    m = samples(await (await client.get("/metrics")).text())
    for p in PHASES:
        count = [s for s in m[f"batcher_request_{p}_seconds"]
                 if s.name.endswith("_count")]
        assert sum(s.value for s in count) == 2, p
    queue = [s for s in m["batcher_request_queue_seconds"] if s.name.endswith("_count")]
    assert {s.labels["priority"] for s in queue} == {"interactive"}
    ttft = [s for s in m["batcher_ttft_seconds"] if s.name.endswith("_count")]
    assert ttft[0].labels == {"priority": "interactive"} and ttft[0].value == 2
    kinds = {s.labels["kind"]: s.value for s in m["batcher_step_seconds"]
             if s.name.endswith("_count")}
    assert kinds.get("prefill", 0) >= 2 and kinds.get("decode", 0) >= 9
    tokens = {s.labels["kind"]: s.value for s in m["batcher_step_tokens"]
              if s.name.endswith("_sum")}
    assert tokens["decode"] >= 9


def test_log_format_json_is_one_object_per_line(capsys) -> None:
    from batcher.telemetry.access_log import configure, log_access

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        configure("info", "json")
        t = split(marks_at(0.0, 0.001, 0.002), EngineTimes(0.01, 0.02, 0.05, 0.05), 0.06)
        log_access(request_id="r1", tenant="t", route="/v1/completions", status=200,
                   timings=t, finish_reason="stop")
        logging.getLogger("batcher.x").warning("plain %s", "words")
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert lines[0]["msg"] == "access" and lines[0]["decode_ms"] == pytest.approx(30)
    assert lines[0]["bottleneck"] == "decode" and lines[0]["level"] == "info"
    assert lines[1] == lines[1] | {"msg": "plain words", "level": "warning"}
    with pytest.raises(ValueError):
        configure("info", "xml")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.25]), min_size=7, max_size=7),
       st.booleans())
def test_the_spelled_out_readers_match_the_phase_table(ms: list[float], routed: bool) -> None:
    # bottleneck, Server-Timing and from_json are written field by field for speed: they must
    # say what the generic forms over `phases()` say, ties included (the first phase wins).
    t = Timings(*ms[:6], total_ms=sum(ms), route_ms=ms[6] if routed else None)
    phases = t.phases()
    assert t.bottleneck == max(phases, key=lambda p: phases[p])
    parts = [f"{p};dur={v:.3f}" for p, v in phases.items()] + [f"total;dur={t.total_ms:.3f}"]
    assert t.server_timing() == ", ".join(parts)
    assert Timings.from_json(orjson.loads(orjson.dumps(t.to_json()))) == t
