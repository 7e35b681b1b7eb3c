"""The replica's HTTP layer in-process (`aiohttp_client`, no subprocess): the same app `batcher
serve` runs, over the tiny random model, so most HTTP behaviour is checked in milliseconds. The
process tests (test_http_api.py and friends) check the same server as a real process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from batcher.admission.admission import Admission
from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.engine.snapshot import CONTRACT_KEYS, EngineSnapshot
from batcher.engine.metrics import Metrics
from batcher.runtime.model_runner import ModelRunner
from batcher.server.admin import create_admin_app
from batcher.server.app import create_app
from batcher.server.auth import Authenticator
from batcher.server.gateway import Gateway, GatewayConfig
from batcher.admission.tenants import TenantConfig, hash_key
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.server_process import DONE, assert_error_shape, sse_events

C = "/v1/completions"
ALICE, BOB = "alice-key", "bob-key"
ADMIN_KEY = "admin-key-for-tests"
TENANTS = {name: TenantConfig(name=name, key_sha256=(hash_key(key),), tokens_per_minute=1e9,
                              max_concurrent=64)
           for name, key in (("alice", ALICE), ("bob", BOB))}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def app_factory(loaded, tokenizer, tenants: dict[str, TenantConfig] | None
                ) -> Callable[[], web.Application]:
    def make() -> web.Application:
        async def build() -> Gateway:
            metrics = Metrics()
            runner = ModelRunner(loaded, num_blocks=128, block_size=16)
            engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=16,
                                 max_num_batched_tokens=256, max_model_len=1024),
                                 metrics=metrics)
            cfg = GatewayConfig(model_name="tiny", max_model_len=1024)
            return Gateway(cfg, engine, Authenticator(tenants), Admission(tenants), metrics)

        return create_app(build, 1 << 20)

    return make


@pytest.fixture
async def client(aiohttp_client, tiny_fp32, tokenizer):
    return await aiohttp_client(app_factory(tiny_fp32, tokenizer, TENANTS)())


def auth(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"Authorization": f"{scheme} {key}"}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0} | kw


def replica_state(resp) -> EngineSnapshot:
    return EngineSnapshot.from_wire(orjson.loads(resp.headers["X-Replica-State"]))


async def test_state_is_the_snapshot_wire_form(client) -> None:
    resp = await client.get("/v1/state")
    assert resp.status == 200
    body = await resp.json()
    assert tuple(body)[:len(CONTRACT_KEYS)] == CONTRACT_KEYS
    snap = EngineSnapshot.from_wire(body)
    assert snap.free_blocks == snap.total_blocks == 128 and snap.block_size == 16
    assert snap.healthy and not snap.draining and snap.running == snap.waiting == 0
    assert "prefix_hit_tokens" not in body  # server-wide: for the admin and fleet keys only
    # The same facts ride on every response, errors included (a replica without a fleet key
    # serves a loopback fleet), but never on a refused credential.
    for method, path, headers in (("GET", "/v1/models", auth(ALICE)),
                                  ("GET", "/nope", auth(ALICE)), ("POST", C, auth(ALICE))):
        r = await client.request(method, path, headers=headers)
        assert replica_state(r).total_blocks == 128, (path, r.status)
        assert "prefix_hit_tokens" not in r.headers["X-Replica-State"]
    for method, path in (("GET", "/nope"), ("POST", C)):
        r = await client.request(method, path)
        assert r.status == 401 and "X-Replica-State" not in r.headers, path


async def test_whole_answer_and_stream_agree(client) -> None:
    resp = await client.post(C, json=completion(), headers=auth(ALICE))
    assert resp.status == 200, await resp.text()
    whole = await resp.json()
    assert whole["usage"]["completion_tokens"] == 4
    assert whole["choices"][0]["finish_reason"] == "length"
    resp = await client.post(C, json=completion(stream=True, stream_options={
        "include_usage": True}), headers=auth(ALICE))
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    events = [ev async for ev in sse_events(resp)]
    assert events[-1] == DONE and events[-2]["usage"] == whole["usage"]
    text = "".join(ev["choices"][0]["text"] for ev in events[:-2])
    assert text == whole["choices"][0]["text"]


async def test_client_errors_are_openai_shaped_never_500(client) -> None:
    cases = [
        ("POST", C, {"data": b"{not json", "headers": auth(ALICE)}, 400, "invalid_json"),
        ("POST", C, {"json": completion(max_tokens="x"), "headers": auth(ALICE)}, 400, None),
        ("POST", C, {"json": completion(), "headers": {**auth(ALICE), "X-Request-Id": "a b"}},
         400, None),
        ("POST", C, {"json": completion(priority="urgent"), "headers": auth(ALICE)}, 400, None),
        ("GET", "/no/such/route", {"headers": auth(ALICE)}, 404, None),
        ("PUT", C, {"headers": auth(ALICE)}, 405, "method_not_allowed"),
    ]
    for method, path, kw, status, code in cases:
        resp = await client.request(method, path, **kw)
        assert resp.status == status, (path, kw, await resp.text())
        err = assert_error_shape(await resp.json())
        assert code is None or err["code"] == code
        assert resp.headers["X-Request-Id"]
    resp = await client.put(C, headers=auth(ALICE))
    assert "POST" in resp.headers["Allow"]


async def test_keys_checked_through_the_toolkit(client) -> None:
    ok = completion(max_tokens=1)
    assert (await client.post(C, json=ok, headers=auth(ALICE, "bearer"))).status == 200
    assert (await client.post(C, json=ok, headers={"x-api-key": BOB})).status == 200
    for headers in ({}, auth("wrong"), auth(ALICE, "Basic"),
                    [("Authorization", f"Bearer {ALICE}"), ("Authorization", f"Bearer {ALICE}")],
                    [("x-api-key", ALICE), ("x-api-key", BOB)]):
        resp = await client.post(C, json=ok, headers=headers)
        assert resp.status == 401, headers
        assert assert_error_shape(await resp.json())["type"] == "authentication_error"


async def test_duplicate_id_in_flight_is_409(client) -> None:
    headers = {**auth(ALICE), "X-Request-Id": "dup-1"}
    first = await client.post(C, json=completion(max_tokens=200, ignore_eos=True, stream=True),
                              headers=headers)
    try:
        assert first.status == 200
        second = await client.post(C, json=completion(), headers=headers)
        assert second.status == 409
        assert assert_error_shape(await second.json())["code"] == "duplicate_request_id"
        # Request IDs are scoped by tenant: Bob may use the same one.
        assert (await client.post(C, json=completion(max_tokens=1), headers={
            **auth(BOB), "X-Request-Id": "dup-1"})).status == 200
    finally:
        first.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_owner_cancel_ends_with_abort_streamed_or_whole(client, stream: bool) -> None:
    """One abort rule for both paths: the partial output, finish_reason "abort", no error."""
    rid = f"cancel-{int(stream)}"
    body = completion(max_tokens=600, ignore_eos=True, stream=stream)
    task = asyncio.create_task(client.post(C, json=body, headers={**auth(ALICE),
                                                                  "X-Request-Id": rid}))
    for _ in range(500):  # until the request runs (bounded: 5 s)
        snap = EngineSnapshot.from_wire(await (await client.get("/v1/state")).json())
        if snap.running:
            break
        await asyncio.sleep(0.01)
    assert (await client.delete(f"/v1/requests/{rid}", headers=auth(BOB))).status == 404
    assert (await client.delete(f"/v1/requests/{rid}", headers=auth(ALICE))).status == 200
    resp = await asyncio.wait_for(task, 10)
    assert resp.status == 200
    if stream:
        events = [ev async for ev in sse_events(resp)]
        assert events[-1] == DONE and not [ev for ev in events[:-1] if "error" in ev]
        finishes = [ev["choices"][0]["finish_reason"] for ev in events[:-1]]
        assert finishes[-1] == "abort" and finishes.count("abort") == 1
    else:
        assert (await resp.json())["choices"][0]["finish_reason"] == "abort"
    for _ in range(300):  # the abort frees the blocks at the next step
        snap = EngineSnapshot.from_wire(await (await client.get("/v1/state")).json())
        if snap.free_blocks == snap.total_blocks:
            break
        await asyncio.sleep(0.01)
    assert snap.free_blocks == snap.total_blocks and snap.running == 0


async def test_admin_listener_drains_the_public_one(aiohttp_client, tiny_fp32, tokenizer) -> None:
    public_app = app_factory(tiny_fp32, tokenizer, None)()
    public = await aiohttp_client(public_app)
    admin = await aiohttp_client(create_admin_app(public_app, ADMIN_KEY))
    for headers in ({}, auth("nope"), [("Authorization", f"Bearer {ADMIN_KEY}")] * 2):
        resp = await admin.post("/admin/drain", headers=headers)
        assert resp.status == 401
        assert assert_error_shape(await resp.json())["code"] == "invalid_api_key"
    resp = await admin.post("/admin/drain", headers=auth(ADMIN_KEY, "bearer"))
    assert resp.status == 200 and (await resp.json())["draining"] is True
    assert (await public.get("/ready")).status == 503
    resp = await public.post(C, json=completion())
    assert resp.status == 503 and resp.headers["Retry-After"]
    assert replica_state(resp).draining
    status = await (await admin.get("/admin/status", headers=auth(ADMIN_KEY))).json()
    assert EngineSnapshot.from_wire(status).draining and status["idle"] is True
    assert (await admin.post("/admin/undrain", headers=auth(ADMIN_KEY))).status == 200
    assert (await public.get("/ready")).status == 200


@pytest.mark.slow
async def test_real_model_default_settings_cancel_and_snapshot(aiohttp_client) -> None:
    """The bundled SmolLM2 with `batcher serve`'s defaults (only the embedding model is left
    out): the snapshot on the wire and the abort rule on a real stream."""
    import argparse

    from batcher.app.serve import gateway_factory
    from batcher.app.serve_flags import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--embedding-model", "none"])
    client = await aiohttp_client(create_app(gateway_factory(args), args.max_body_bytes))
    resp = await client.post(C, json={"model": "smollm2-135m", "prompt": "The capital of France",
                                      "max_tokens": 4, "temperature": 0})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 4
    assert replica_state(resp).healthy
    body = {"model": "smollm2-135m", "prompt": "Count slowly:", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    resp = await client.post(C, json=body, headers={"X-Request-Id": "real-cancel"})
    assert resp.status == 200
    events = sse_events(resp)
    assert (await anext(events))["choices"][0]["finish_reason"] is None
    assert (await client.delete("/v1/requests/real-cancel")).status == 200
    rest = [ev async for ev in events]
    assert rest[-1] == DONE and not [ev for ev in rest[:-1] if "error" in ev]
    assert rest[-2]["choices"][0]["finish_reason"] == "abort"
    snap = EngineSnapshot.from_wire(await (await client.get("/v1/state")).json())
    assert tuple(snap.to_wire())[:len(CONTRACT_KEYS)] == CONTRACT_KEYS


def test_embedding_body_floats_and_base64() -> None:
    import base64
    import struct

    from batcher.server.embeddings_route import embedding_body

    vecs = [[0.5, -1.0], [0.25, 2.0]]
    body = embedding_body("m", vecs, "float", 7)
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and body["model"] == "m"
    assert [d["embedding"] for d in body["data"]] == vecs
    assert [d["index"] for d in body["data"]] == [0, 1]
    packed = embedding_body("m", vecs, "base64", 7)["data"][1]["embedding"]
    assert list(struct.unpack("<2f", base64.b64decode(packed))) == vecs[1]


async def test_a_flood_of_malformed_requests_cools_its_tenant_down_alone(client) -> None:
    """Past `threshold` 400s within the window, the tenant's requests with a body are refused
    before they are read (429 `malformed_cooldown`, Retry-After, the connection closed, the
    answer held); another tenant is served as usual. The threshold is lowered here: the default
    rate is a flood's (`batcher.server.malformed_cooldown`)."""
    import time

    from batcher.server.appkeys import GATEWAY
    from batcher.server.cooldown import HOLD_S
    from batcher.server.malformed_cooldown import malformed_cooldown

    client.server.app[GATEWAY].malformed_cooldown = malformed_cooldown(threshold=5, window_s=60)
    for _ in range(5):
        r = await client.post(C, data=b'{"prompt": [[[', headers={
            **auth(ALICE), "Content-Type": "application/json"})
        assert r.status == 400, await r.text()
    start = time.monotonic()
    r = await client.post(C, json=completion(), headers=auth(ALICE))
    assert r.status == 429, await r.text()
    assert assert_error_shape(await r.json())["code"] == "malformed_cooldown"
    assert 1 <= int(r.headers["Retry-After"]) <= 10
    assert r.headers.get("Connection", "").lower() == "close"
    assert time.monotonic() - start >= HOLD_S - 0.05
    r = await client.post(C, json=completion(), headers=auth(BOB))
    assert r.status == 200, await r.text()
