"""Access lines tell how every request ended: a stream its client cut, a stream shutdown cut and
a whole answer each carry the phases and tokens that really ran, an `outcome` and the engine's
`finish_reason`; every refusal (key, route, model, body, tenant budget, concurrency, queue,
drain, duplicate id) has a line naming its reason, and a 429/503 names it in `X-Reject-Reason`
too. In process, on the fake model (its decode rate is set)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from batcher.engine.fake_runner import FakeSpeed
from batcher.server.appkeys import GATEWAY
from batcher.admission.tenants import TenantConfig, hash_key
from tests.test_diagnose import fake_app as diagnose_app

C = "/v1/completions"
ALICE, ALICE2, CAROL = "alice-key", "alice-2", "carol-key"  # carol: a tiny token budget
TENANTS = {"alice": TenantConfig(name="alice", key_sha256=(hash_key(ALICE),),
                                 tokens_per_minute=1e9, max_concurrent=2),
           "alice2": TenantConfig(name="alice2", key_sha256=(hash_key(ALICE2),),
                                  tokens_per_minute=1e9, max_concurrent=2),
           "carol": TenantConfig(name="carol", key_sha256=(hash_key(CAROL),),
                                 tokens_per_minute=60, burst=20, max_concurrent=4)}
STEP_S = 0.01  # the fake model's decode step

pytestmark = pytest.mark.usefixtures("frozen_gc")


def fake_app(max_num_seqs: int = 4, max_waiting: int = 64) -> web.Application:
    return diagnose_app(FakeSpeed(decode_step_s=STEP_S), max_num_seqs=max_num_seqs,
                        max_waiting=max_waiting, tenants=TENANTS, body_limit=1 << 16)


def body(max_tokens: int, stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": [300] * 8, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, **kw}


def key(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


async def access_line(caplog, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
    """The access line of `request_id` (its fields), once it is written."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for rec in caplog.records:
            fields = getattr(rec, "access", None)
            if rec.name == "batcher.access" and fields and fields["request_id"] == request_id:
                return fields
        await asyncio.sleep(0.02)
    raise AssertionError(f"no access line for {request_id}")


def histogram(text: str, name: str, part: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == f"{name}_{part}")


async def warmed(client) -> None:
    """One short request first: the process's first steps pay for lazy set-up (seen: 0.5 s
    of queue), which would outweigh the decoding these tests measure."""
    r = await client.post(C, json=body(2), headers=key(ALICE))
    assert r.status == 200


async def read_chunks(resp, n: int) -> int:
    """Read the stream until `n` text chunks are in; returns how many were."""
    got = 0
    while got < n:
        line = await resp.content.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {") and b'"text":""' not in line:
            got += 1
    return got


@pytest.mark.parametrize("cancellation", [False, True], ids=["write-fails", "handler-cancelled"])
async def test_a_stream_the_client_cut_logs_what_ran(aiohttp_client, caplog,
                                                     cancellation: bool) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await aiohttp_client(fake_app(), server_kwargs={
        "handler_cancellation": cancellation})
    await warmed(client)
    resp = await client.post(C, json=body(400, stream=True),
                             headers=key(ALICE) | {"X-Request-Id": "cut-1"})
    assert resp.status == 200
    got = await read_chunks(resp, 30)
    resp.close()  # the client goes away mid-stream
    line = await access_line(caplog, "cut-1")
    assert line["outcome"] == "client_disconnect", line
    # The tokens that ran, not zero; the time was decoding, not queueing.
    assert got <= line["completion_tokens"] < 400, line
    assert line["prompt_tokens"] == 8
    assert line["decode_ms"] >= (got - 1) * STEP_S * 1000 * 0.5, line
    assert line["bottleneck"] == "decode" and line["queue_ms"] < line["decode_ms"], line
    # The phase histograms take the same numbers.
    metrics = await (await client.get("/metrics")).text()
    decode = "batcher_request_decode_seconds"
    assert histogram(metrics, decode, "count") == 2  # the cut request and the warm-up
    assert histogram(metrics, decode, "sum") >= line["decode_ms"] / 1000


async def test_a_stream_shutdown_cut_logs_what_ran(aiohttp_client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await aiohttp_client(fake_app())
    await warmed(client)
    resp = await client.post(C, json=body(400, stream=True),
                             headers=key(ALICE) | {"X-Request-Id": "shut-1"})
    got = await read_chunks(resp, 20)
    gw = client.server.app[GATEWAY]
    # What `batcher serve` does on SIGTERM once the drain's time is up.
    gw.set_draining(True)
    await gw.engine.stop("the server shut down before this request finished")
    rest = await resp.text()
    assert "shut down before this request finished" in rest  # the stream says so
    line = await access_line(caplog, "shut-1")
    assert line["outcome"] == "shutdown" and line["finish_reason"] == "error", line
    assert got <= line["completion_tokens"] < 400 and line["prompt_tokens"] == 8, line
    assert line["decode_ms"] > 0 and line["bottleneck"] == "decode", line


async def test_a_whole_answer_logs_done_with_its_finish_reason(aiohttp_client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await aiohttp_client(fake_app())
    r = await client.post(C, json=body(5), headers=key(ALICE) | {"X-Request-Id": "ok-1"})
    assert r.status == 200
    line = await access_line(caplog, "ok-1")
    assert line["outcome"] == "done" and line["finish_reason"] == "length"
    assert line["completion_tokens"] == 5 and line["status"] == 200


async def test_every_refusal_has_a_line_with_its_reason(aiohttp_client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    # One sequence at a time and one waiting: the third request finds the queue full.
    client = await aiohttp_client(fake_app(max_num_seqs=1, max_waiting=1))

    async def refused(rid: str, status: int, code: str, method: str = "POST", path: str = C,
                      **kw: Any) -> dict[str, Any]:
        headers = kw.pop("headers", key(ALICE)) | {"X-Request-Id": rid}
        r = await client.request(method, path, headers=headers, **kw)
        assert r.status == status, (rid, await r.text())
        assert (await r.json())["error"]["code"] == code
        if status in (429, 503):
            assert r.headers["X-Reject-Reason"] == code and "Retry-After" in r.headers
        line = await access_line(caplog, rid)
        assert (line["status"], line["error_code"], line["outcome"]) == (
            status, code, "refused"), line
        return line

    await refused("no-key", 401, "invalid_api_key", headers=key("wrong"), json=body(2))
    line = await refused("no-route", 404, "not_found", "GET", "/v1/nothing-here")
    assert line["route"] == "/v1/nothing-here"  # an unknown route: the path is the news
    # A known route logs its pattern: the ids in a path are the caller's, never the line's.
    line = await refused("cancel", 404, "request_not_found", "DELETE",
                         "/v1/requests/someone-elses-id-4f2a")
    assert line["route"] == "/v1/requests/{id}", line
    await refused("no-model", 400, "model_not_found", json=body(2) | {"model": "gpt-9"})
    await refused("bad-json", 400, "invalid_json", data=b"{")
    await refused("too-big", 413, "body_too_large", data=b"x" * (1 << 17))
    spent = await client.post(C, json=body(8), headers=key(CAROL))  # 16 of carol's 20
    assert spent.status == 200
    await refused("budget", 429, "tenant_tokens", headers=key(CAROL), json=body(8))

    # Two long streams hold alice's concurrency (2), the one sequence and the one waiting slot.
    gw = client.server.app[GATEWAY]
    holders = [asyncio.create_task(client.post(C, json=body(400, stream=True),
                                               headers=key(ALICE))) for _ in range(2)]
    while len(gw.jobs) < 2:
        await asyncio.sleep(0.01)
    await refused("busy", 429, "tenant_concurrency", json=body(2))
    await refused("full", 503, "queue_full", headers=key(ALICE2), json=body(2))
    for h in holders:
        (await h).close()
    gw.set_draining(True)
    await refused("drain", 503, "draining", json=body(2))
