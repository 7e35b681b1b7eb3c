"""`batcher bench` says why the server refused: by the reason in `X-Reject-Reason` (else the
error body's code), every refused answer and the refusals that ended requests; with `--retries`
it honours Retry-After and reports the time spent waiting. Against a router it reads the
router's own /metrics rather than calling it absent."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from batcher.bench.client import ClientConfig, send_request
from batcher.bench.report import (
    MetricsScraper,
    refusal_lines,
    server_lines,
    summarize,
    table_row,
)
from batcher.bench.workload import BenchRequest
from batcher.fleet.router.metrics import RouterMetrics
from batcher.http.errors import ApiError


def refusing_app(reasons: list[tuple[int, str | None, str | None]]) -> web.Application:
    """Answers each request with the next (status, X-Reject-Reason, body code) until the list
    runs out, then with a one-token stream; Retry-After 1 on every refusal."""
    left = list(reasons)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if left:
            status, header, code = left.pop(0)
            err = ApiError(status, "no", code=code, retry_after=0.05,
                           headers={"X-Reject-Reason": header} if header else None)
            resp = err.response()
            if header is None:
                resp.headers.popall("X-Reject-Reason", None)
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"hi","finish_reason":"length"}]}\n\n'
                         b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


async def run(client, retries: int, n: int):
    cfg = ClientConfig(str(client.make_url("")).rstrip("/"), "m", max_retries=retries,
                       request_timeout=30)
    async with aiohttp.ClientSession() as session:
        return [await send_request(session, cfg, BenchRequest(f"r{i}", [1], None, 1), 0.0)
                for i in range(n)]


async def test_refusals_are_reported_by_reason(aiohttp_client) -> None:
    client = await aiohttp_client(refusing_app([
        (503, "queue_slo", "queue_slo"), (503, "queue_slo", "queue_slo"),
        (429, None, "tenant_tokens"),  # no header: the body's code names it
        (503, None, None)]))
    results = await run(client, retries=0, n=5)
    s = summarize(results)
    assert s["errors_by_kind"] == {"429": 1, "503": 3}
    assert s["refusals_by_reason"] == {"503 queue_slo": 2, "429 tenant_tokens": 1,
                                       "503 unknown": 1}
    errors = table_row("run", s)[3]
    assert "503: 3 (queue_slo 2, unknown 1)" in errors and "429: 1 (tenant_tokens 1)" in errors
    (line,) = refusal_lines(s)
    assert "503 queue_slo 2" in line and "none sent again" in line


async def test_retries_honour_retry_after_and_report_the_wait(aiohttp_client) -> None:
    # Retry-After is whole seconds (the 0.05 s asked is rounded up to 1): two refusals cost
    # the one request that met them two seconds of waiting.
    client = await aiohttp_client(refusing_app([(503, "queue_full", "queue_full")] * 2))
    results = await asyncio.wait_for(run(client, retries=2, n=2), 30)
    assert [r.kind for r in results] == ["ok", "ok"]
    s = summarize(results)
    assert s["refusals_by_reason"] == {"503 queue_full": 2} and s["final_refusals"] == {}
    assert s["retry_wait_s"] == pytest.approx(2.0)
    (line,) = refusal_lines(s)
    assert "1 requests sent again 2 times after waiting 2.0 s" in line


async def test_a_routers_metrics_are_read_as_a_routers(aiohttp_client) -> None:
    rm = RouterMetrics()
    rm.replicas.labels("routable").set(2)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=rm.exposition(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    client = await aiohttp_client(app)
    async with aiohttp.ClientSession() as session:
        scraper = MetricsScraper(session, str(client.make_url("")).rstrip("/"), 60)
        await scraper.start()
        rm.client_requests.labels("ok").inc(3)
        await scraper.stop()
    summary = scraper.summary()
    assert summary is not None and summary["router"] is True
    assert summary["client_requests"] == 3 and summary["replicas_routable"] == 2
    (line,) = server_lines(summary)
    assert line.startswith("router metrics: 3 client requests") and "none" not in line
