"""/v1/responses and /v1/messages over HTTP in-process (`aiohttp_client`) on the tiny random
model: what the translation does end to end that shapes alone cannot show. Forced tool calls and
JSON schemas go through the grammar engine (valid even from random weights); a continued
response carries its earlier turns; refusals name the client's fields, in Anthropic's shape on
/v1/messages, 429s with Retry-After included; stored responses are per tenant."""

from __future__ import annotations

import json
import threading
from typing import Any

import orjson
import pytest
from aiohttp import web

from batcher.admission.admission import Admission
from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.engine.metrics import Metrics
from batcher.runtime.model_runner import ModelRunner
from batcher.server.app import create_app
from batcher.server.auth import Authenticator
from batcher.server.gateway import Gateway, GatewayConfig
from batcher.server.responses_route import RESPONSES
from batcher.admission.tenants import TenantConfig, hash_key
from batcher.tokenizer.tokenizer import load_tokenizer

ALICE, BOB, SMALL = "alice-key", "bob-key", "small-key"
TENANTS = {
    "alice": TenantConfig(name="alice", key_sha256=(hash_key(ALICE),), tokens_per_minute=1e9,
                          max_concurrent=16),
    "bob": TenantConfig(name="bob", key_sha256=(hash_key(BOB),), tokens_per_minute=1e9,
                        max_concurrent=16),
    # One small request fits the bucket; the next waits for the refill.
    "small": TenantConfig(name="small", key_sha256=(hash_key(SMALL),), tokens_per_minute=60,
                          burst=60, max_concurrent=4)}
# An enum, so random weights close the call in a few tokens.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make_app(loaded: Any, tokenizer: Any, reasoning_parser: str | None = None
             ) -> web.Application:
    async def build() -> Gateway:
        metrics = Metrics()
        engine = AsyncEngine(ModelRunner(loaded, num_blocks=128, block_size=16), tokenizer,
                             SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                             max_model_len=1024), metrics=metrics)
        cfg = GatewayConfig(model_name="tiny", max_model_len=1024,
                            reasoning_parser=reasoning_parser)
        return Gateway(cfg, engine, Authenticator(TENANTS), Admission(TENANTS), metrics)

    return create_app(build, 1 << 20)


@pytest.fixture
async def client(aiohttp_client, tiny_fp32, tokenizer):
    return await aiohttp_client(make_app(tiny_fp32, tokenizer))


def key(k: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


async def post(client: Any, path: str, body: dict[str, Any], k: str = ALICE,
               status: int = 200) -> dict[str, Any]:
    resp = await client.post(path, json=body, headers=key(k))
    assert resp.status == status, await resp.text()
    return await resp.json()


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n", 1)
            out.append((head.removeprefix(b"event: ").decode(), orjson.loads(data[6:])))
    return out


async def test_forced_tool_call_whole_and_streamed(client) -> None:
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [TOOL],
            "tool_choice": "required", "max_output_tokens": 60, "temperature": 0,
            "parallel_tool_calls": False}
    r = await post(client, "/v1/responses", body)
    calls = [i for i in r["output"] if i["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Lyon")
    resp = await client.post("/v1/responses", json=dict(body, stream=True), headers=key())
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    out = sse(await resp.read())
    deltas = "".join(d["delta"] for n, d in out if n == "response.function_call_arguments.delta")
    done = next(d for n, d in out if n == "response.function_call_arguments.done")
    assert deltas == done["arguments"] and json.loads(deltas)["city"] in ("Paris", "Lyon")
    assert out[-1][0] == "response.completed"
    assert out[-1][1]["response"]["output"][-1]["arguments"] == deltas


async def test_text_format_json_schema_constrains_the_answer(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = await post(client, "/v1/responses", {
        "model": "tiny", "input": "Answer.", "max_output_tokens": 30, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}}})
    assert isinstance(json.loads(r["output"][0]["content"][0]["text"])["ok"], bool)
    assert r["text"]["format"]["name"] == "answer"


async def test_previous_response_carries_earlier_turns(client) -> None:
    first = await post(client, "/v1/responses", {"model": "tiny", "input": "One two three",
                                                 "max_output_tokens": 4})
    second = await post(client, "/v1/responses", {
        "model": "tiny", "input": "four", "max_output_tokens": 4,
        "previous_response_id": first["id"]})
    alone = await post(client, "/v1/responses", {"model": "tiny", "input": "four",
                                                 "max_output_tokens": 4, "store": False})
    # The continuation's prompt holds the first turn's input and output as well.
    assert second["usage"]["input_tokens"] >= (alone["usage"]["input_tokens"]
                                               + first["usage"]["output_tokens"] + 3)
    assert second["previous_response_id"] == first["id"]
    got = await client.get(f"/v1/responses/{second['id']}", headers=key())
    assert got.status == 200 and (await got.json())["output"] == second["output"]
    for path in (f"/v1/responses/{second['id']}", f"/v1/responses/{alone['id']}"):
        other = await client.get(path, headers=key(BOB))  # another tenant's, or not stored
        assert other.status == 404
    miss = await client.get(f"/v1/responses/{alone['id']}", headers=key())
    assert miss.status == 404 and (await miss.json())["error"]["param"] == "response_id"
    assert (await client.delete(f"/v1/responses/{second['id']}", headers=key(BOB))).status == 404
    gone = await client.delete(f"/v1/responses/{second['id']}", headers=key())
    assert (await gone.json()) == {"id": second["id"], "object": "response", "deleted": True}
    err = await post(client, "/v1/responses", {"model": "tiny", "input": "x",
                                               "previous_response_id": second["id"]},
                     status=404)
    assert err["error"]["param"] == "previous_response_id"


class ThreadRecorder:
    """A store that records which thread each call ran on."""

    def __init__(self, store: Any) -> None:
        self.store, self.threads = store, []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.threads.append((name, threading.current_thread()))
            return fn(*args)

        return call


async def test_store_calls_run_off_the_event_loop(client) -> None:
    handler = client.app[RESPONSES]
    handler.store = rec = ThreadRecorder(handler.store)
    first = await post(client, "/v1/responses", {"model": "tiny", "input": "Hi",
                                                 "max_output_tokens": 2})
    resp = await client.post("/v1/responses", headers=key(), json={
        "model": "tiny", "input": "Again", "max_output_tokens": 2, "stream": True,
        "previous_response_id": first["id"]})
    final = sse(await resp.read())[-1]
    assert final[0] == "response.incomplete"  # max_output_tokens; stored all the same
    assert (await client.get(f"/v1/responses/{final[1]['response']['id']}",
                             headers=key())).status == 200
    assert (await client.delete(f"/v1/responses/{first['id']}", headers=key())).status == 200
    assert sorted({name for name, _ in rec.threads}) == ["delete", "get", "put"]
    loop_thread = threading.current_thread()
    assert all(t is not loop_thread for _, t in rec.threads), rec.threads


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "nope"}, "model"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"tools": [TOOL], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"type": "input_image"}]}, "input"),
])
async def test_responses_refusals_name_the_field(client, body: dict[str, Any],
                                                 param: str) -> None:
    err = await post(client, "/v1/responses", {"model": "tiny", "input": "Hi", **body},
                     status=400)
    assert err["error"]["param"] == param, err
    assert param.split(".")[0] in err["error"]["message"] or param == "input", err


async def test_messages_whole_stream_and_count(client) -> None:
    body = {"model": "tiny", "max_tokens": 5, "system": "Be brief.", "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    resp = await client.post("/v1/messages", json=body,
                             headers={"x-api-key": ALICE, "anthropic-version": "2023-06-01"})
    assert resp.status == 200
    m = await resp.json()
    assert m["type"] == "message" and m["stop_reason"] == "max_tokens"
    assert m["usage"]["output_tokens"] == 5 and m["content"][0]["type"] == "text"
    count = await post(client, "/v1/messages/count_tokens",
                       {"model": "tiny", "system": "Be brief.", "messages": body["messages"]})
    assert count == {"input_tokens": m["usage"]["input_tokens"]}
    resp = await client.post("/v1/messages", json=dict(body, stream=True),
                             headers={"x-api-key": ALICE})
    out = sse(await resp.read())
    assert [n for n, _ in out][:3] == ["message_start", "ping", "content_block_start"]
    assert [n for n, _ in out][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in out if n == "content_block_delta")
    assert text == m["content"][0]["text"]
    assert out[-2][1]["usage"]["output_tokens"] == 5


async def test_messages_forced_tool_use(client) -> None:
    m = await post(client, "/v1/messages", {
        "model": "tiny", "max_tokens": 60, "temperature": 0,
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    [use] = m["content"]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert use["input"]["city"] in ("Paris", "Lyon") and m["stop_reason"] == "tool_use"


def anthropic_error(body: dict[str, Any], kind: str) -> str:
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


async def test_messages_errors_take_anthropics_shape(client) -> None:
    resp = await client.post("/v1/messages", json={"model": "tiny", "messages": []},
                             headers={"x-api-key": "wrong"})
    assert resp.status == 401
    anthropic_error(await resp.json(), "authentication_error")
    resp = await client.post("/v1/messages", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, headers=key())
    assert resp.status == 400
    assert "max_tokens" in anthropic_error(await resp.json(), "invalid_request_error")
    resp = await client.post("/v1/messages", data=b"{not json", headers=key())
    assert resp.status == 400
    anthropic_error(await resp.json(), "invalid_request_error")
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    first = await client.post("/v1/messages", json=body, headers={"x-api-key": SMALL})
    assert first.status == 200
    second = await client.post("/v1/messages", json=body, headers={"x-api-key": SMALL})
    assert second.status == 429 and int(second.headers["Retry-After"]) >= 1
    anthropic_error(await second.json(), "rate_limit_error")
    # The chat route keeps OpenAI's shape.
    chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": []},
                             headers=key())
    assert chat.status == 400 and "error" in await chat.json()


async def test_reasoning_parser_output_as_reasoning_items_and_thinking_blocks(
        aiohttp_client, tiny_fp32, tokenizer) -> None:
    """deepseek_r1: an answer reasons from its first token until `</think>`, so the tiny
    model's answer is all reasoning."""
    client = await aiohttp_client(make_app(tiny_fp32, tokenizer, "deepseek_r1"))
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 0,
            "reasoning": {"effort": "low"}}
    r = await post(client, "/v1/responses", body)
    assert r["output"][0]["type"] == "reasoning" and r["reasoning"]["effort"] == "low"
    thought = r["output"][0]["content"][0]["text"]
    resp = await client.post("/v1/responses", json=dict(body, stream=True), headers=key())
    out = sse(await resp.read())
    assert "".join(d["delta"] for n, d in out if n == "response.reasoning_text.delta") == thought
    assert out[-1][1]["response"]["output"] == [
        dict(r["output"][0], id=out[-1][1]["response"]["output"][0]["id"])]
    m = await post(client, "/v1/messages", {
        "model": "tiny", "max_tokens": 4, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Hi"}]})
    assert m["content"] == [{"type": "thinking", "thinking": thought, "signature": ""}]
