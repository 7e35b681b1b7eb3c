"""The router's access lines say as much as a replica's: a relayed refusal names the replica's
error code (and passes on its `X-Reject-Reason`), a whole answer and a stream their
`finish_reason`, and a stream its client cut the tokens relayed before the cut. In process: the
router in front of one replica on the fake model (`tests.test_access_outcomes.fake_app`).

Router and replica log to the same logger under the same request id; the replica's lines are
diverted into a list (`replica_lines`), so every line the test reads is the router's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import batcher.server.timing as replica_timing
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from tests.fleet.procs import STUB_STATE
from tests.test_access_outcomes import (
    ALICE,
    CAROL,
    access_line,
    body,
    fake_app,
    key,
    read_chunks,
)

C = "/v1/completions"

pytestmark = pytest.mark.usefixtures("frozen_gc")


@pytest.fixture
def replica_lines(monkeypatch) -> list[dict[str, Any]]:
    """The replica's own access lines, kept out of the log."""
    lines: list[dict[str, Any]] = []
    monkeypatch.setattr(replica_timing, "log_access", lambda **kw: lines.append(kw))
    return lines


async def router_client(aiohttp_client, aiohttp_server, cancellation: bool = True) -> Any:
    replica = await aiohttp_server(fake_app())
    ctx = RouterContext(RouterConfig())
    ctx.registry.add_static(str(replica.make_url("")).rstrip("/"), "r0")
    assert ctx.registry.observe("r0", STUB_STATE, ctx.clock(), poll=True)
    return await aiohttp_client(create_router_app(ctx),
                                server_kwargs={"handler_cancellation": cancellation})


def replica_line(lines: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    return next(line for line in lines if line["request_id"] == rid)


async def test_a_relayed_refusal_names_the_replicas_code(aiohttp_client, aiohttp_server,
                                                         caplog, replica_lines) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await router_client(aiohttp_client, aiohttp_server)
    r = await client.post(C, json=body(2) | {"model": "gpt-9"},
                          headers=key(ALICE) | {"X-Request-Id": "no-model"})
    assert r.status == 400
    line = await access_line(caplog, "no-model")
    assert (line["status"], line["error_code"], line["outcome"]) == (
        400, "model_not_found", "refused"), line
    assert replica_line(replica_lines, "no-model")["error_code"] == "model_not_found"

    spent = await client.post(C, json=body(8), headers=key(CAROL))  # 16 of carol's 20 tokens
    assert spent.status == 200
    r = await client.post(C, json=body(8), headers=key(CAROL) | {"X-Request-Id": "budget"})
    assert r.status == 429 and r.headers["X-Reject-Reason"] == "tenant_tokens"
    line = await access_line(caplog, "budget")
    assert (line["status"], line["error_code"], line["outcome"]) == (
        429, "tenant_tokens", "refused"), line


async def test_whole_answers_and_streams_carry_their_finish_reason(
        aiohttp_client, aiohttp_server, caplog, replica_lines) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await router_client(aiohttp_client, aiohttp_server)
    r = await client.post(C, json=body(5), headers=key(ALICE) | {"X-Request-Id": "whole"})
    assert r.status == 200
    line = await access_line(caplog, "whole")
    assert (line["outcome"], line["finish_reason"], line["completion_tokens"]) == (
        "done", "length", 5), line
    assert "error_code" not in line

    r = await client.post(C, json=body(5, stream=True) | {
        "stream_options": {"include_usage": True}},
        headers=key(ALICE) | {"X-Request-Id": "streamed"})
    assert r.status == 200 and b"[DONE]" in await r.read()
    line = await access_line(caplog, "streamed")
    assert (line["outcome"], line["finish_reason"]) == ("done", "length"), line
    assert replica_line(replica_lines, "streamed")["finish_reason"] == "length"


@pytest.mark.parametrize("cancellation", [False, True], ids=["write-fails", "handler-cancelled"])
async def test_a_stream_the_client_cut_logs_the_tokens_relayed(
        aiohttp_client, aiohttp_server, caplog, replica_lines, cancellation: bool) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await router_client(aiohttp_client, aiohttp_server, cancellation)
    resp = await client.post(C, json=body(400, stream=True),
                             headers=key(ALICE) | {"X-Request-Id": "cut"})
    assert resp.status == 200
    got = await read_chunks(resp, 30)
    resp.close()  # the client goes away mid-stream
    line = await access_line(caplog, "cut")
    assert line["outcome"] == "client_disconnect", line
    # A cancelled handler logs 499; a write that failed after the stream's 200 logs that 200.
    # (Seen here without handler cancellation too: the relay, waiting on the replica, is
    # cancelled before its next write fails.)
    assert line["status"] in ((499,) if cancellation else (200, 499)), line
    assert got <= line["completion_tokens"] < 400, line
    # The replica's phases never reached the router: none is written, no bottleneck blamed.
    assert line["total_ms"] > 0 and "bottleneck" not in line and "queue_ms" not in line, line
    # The replica aborted the request too (the router closed its upstream connection).
    for _ in range(100):
        if any(r["request_id"] == "cut" for r in replica_lines):
            break
        await asyncio.sleep(0.05)
    assert replica_line(replica_lines, "cut")["outcome"] == "client_disconnect"


async def test_a_relayed_models_refusal_has_a_line(aiohttp_client, aiohttp_server,
                                                   caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.access")
    client = await router_client(aiohttp_client, aiohttp_server)
    r = await client.get("/v1/models", headers=key("wrong") | {"X-Request-Id": "models-401"})
    assert r.status == 401
    line = await access_line(caplog, "models-401")
    assert (line["status"], line["error_code"]) == (401, "invalid_api_key"), line
