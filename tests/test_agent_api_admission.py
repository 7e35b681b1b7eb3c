"""Admission refusals on /v1/responses and /v1/messages, in-process on the fake model: a 503 with
`Retry-After` and `X-Reject-Reason`, in OpenAI's error shape on Responses and Anthropic's on
Messages, whole or streamed (the refusal comes before any event), counted under each route."""

from __future__ import annotations

from typing import Any

import orjson

from batcher.engine.fake_runner import FakeSpeed
from batcher.server.appkeys import GATEWAY
from tests.server_process import assert_error_shape
from tests.test_diagnose import fake_app
from tests.test_gateway_inprocess import ALICE
from tests.test_metrics_contract import labelled

RESPONSES = {"model": "fake", "input": "Hi", "max_output_tokens": 4}
MESSAGES = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


async def refused(client: Any, path: str, body: dict[str, Any], headers: dict[str, str]
                  ) -> dict[str, Any]:
    resp = await client.post(path, data=orjson.dumps(body), headers=headers)
    assert resp.status == 503, await resp.text()
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["X-Reject-Reason"] == "draining"
    assert resp.headers["Content-Type"].startswith("application/json")
    return orjson.loads(await resp.read())


async def test_admission_refusals_take_each_apis_shape(aiohttp_client) -> None:
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.001)))
    # Draining: admission refuses every request with 503 + Retry-After, as when overloaded.
    client.app[GATEWAY].admission.set_draining(True)
    bearer = {"Authorization": f"Bearer {ALICE}"}
    for stream in (False, True):
        err = assert_error_shape(await refused(client, "/v1/responses",
                                               dict(RESPONSES, stream=stream), bearer))
        assert err["code"] == "draining" and "draining" in err["message"]
        # Anthropic's clients send the key as x-api-key; the refusal is in their shape.
        body = await refused(client, "/v1/messages", dict(MESSAGES, stream=stream),
                             {"x-api-key": ALICE, "anthropic-version": "2023-06-01"})
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert body["error"]["type"] == "overloaded_error" and body["error"]["message"]
    text = await (await client.get("/metrics")).text()
    assert labelled(text, "batcher_requests_rejected_total") == {(("reason", "draining"),): 4.0}
    assert labelled(text, "batcher_requests_by_route_total") == {
        (("route", "/v1/responses"), ("status", "503")): 2.0,
        (("route", "/v1/messages"), ("status", "503")): 2.0}
