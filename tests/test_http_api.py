"""The HTTP API against a real `batcher serve` process on 127.0.0.1: validation (a table of
malformed inputs, all 4xx in OpenAI's error shape), request IDs, disconnects freeing KV blocks,
health/state/metrics/probe, SIGTERM drain and `batcher serve --help`."""

from __future__ import annotations

import asyncio
import gzip
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import (
    DONE,
    ROOT,
    Server,
    assert_error_shape,
    get_state,
    serve,
    server_fixture,
    sse_events,
    wait_idle,
    wait_state,
)

MODEL = "tiny"
VOCAB = 49152  # the bundled tokenizer's vocabulary (the tiny model uses it)
# Long enough to still be running when the test acts on it (tiny decodes ~1000 tokens/s), short
# enough to fit the 256-block KV pool with room to spare.
LONG = 3000

# The deep probe needs the admin or fleet key.
PROBE_KEY = "http-api-fleet-key"
server = server_fixture(env={"BATCHER_FLEET_KEY": PROBE_KEY})
FLEET = {"X-Fleet-Key": PROBE_KEY}  # as a router sends it


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def completion(prompt: Any = "Hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}


def chat(messages: Any = None, **kw: Any) -> dict[str, Any]:
    if messages is None:
        messages = [{"role": "user", "content": "Hi"}]
    return {"model": MODEL, "messages": messages,
            "max_tokens": 4, **kw}


def replica_state(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The piggybacked `X-Replica-State` JSON (DESIGN: on every replica response to its
    fleet, which sends the fleet key in `X-Fleet-Key`)."""
    raw = resp.headers.get("X-Replica-State")
    assert raw is not None, f"no X-Replica-State on {resp.method} {resp.url.path}"
    st = orjson.loads(raw)
    assert {"free_blocks", "total_blocks", "running", "waiting"} <= set(st)
    return st


async def assert_serves(session: aiohttp.ClientSession, url: str) -> None:
    """A normal request still succeeds."""
    async with session.post(url + "/v1/completions", json=completion(max_tokens=2)) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


# -- malformed inputs ------------------------------------------------------------------------

C, H = "/v1/completions", "/v1/chat/completions"
BAD: list[tuple[str, str, Any]] = [
    # (id, path, body: bytes sent as-is, anything else as JSON)
    ("bad-json", C, b'{"model": "tiny", "prompt": '),
    ("empty-body", C, b""),
    ("json-nan-literal", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}'),
    ("json-lone-surrogate", C, b'{"model": "tiny", "prompt": "\\ud800"}'),
    ("not-utf8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    ("body-list", C, [1, 2, 3]),
    ("body-string", H, "hello"),
    ("body-null", C, None),
    ("body-number", C, 42),
    ("model-null-prompt-missing", C, {"model": None}),
    ("unknown-model", C, completion(model="gpt-4")),
    ("model-control-chars", C, completion(model="tiny\x00\x1b[31m")),
    ("model-unicode", H, chat(model="tíny\u202e")),
    ("model-wrong-type", C, completion(model=["tiny"])),
    ("missing-prompt", C, {"model": MODEL}),
    ("prompt-number", C, completion(prompt=123)),
    ("prompt-dict", C, completion(prompt={"text": "x"})),
    ("prompt-mixed-list", C, completion(prompt=["a", 1])),
    ("prompt-empty-list", C, completion(prompt=[])),
    ("prompt-ids-negative", C, completion(prompt=[1, -1])),
    ("prompt-ids-vocab", C, completion(prompt=[1, VOCAB])),
    ("prompt-ids-huge", C, completion(prompt=[2**62])),
    ("prompt-ids-bool", C, completion(prompt=[True, 2])),
    ("prompt-ids-float", C, completion(prompt=[1.0, 2])),
    ("prompt-ids-empty-inner", C, completion(prompt=[[1, 2], []])),
    ("max-tokens-string", C, completion(max_tokens="10")),
    ("max-tokens-float", C, completion(max_tokens=1.5)),
    ("max-tokens-zero", C, completion(max_tokens=0)),
    ("max-tokens-negative", C, completion(max_tokens=-5)),
    ("max-tokens-huge", C, completion(max_tokens=10**12)),
    ("max-tokens-over-context", C, completion(max_tokens=5000)),
    ("max-completion-tokens-bad", H, chat(max_completion_tokens=-1)),
    ("max-tokens-u64", C, b'{"model": "tiny", "prompt": "x", "max_tokens": 18446744073709551616}'),
    ("temperature-string", C, completion(temperature="hot")),
    ("temperature-nan-string", C, completion(temperature="NaN")),
    ("temperature-inf-string", C, completion(temperature="Infinity")),
    ("temperature-negative", C, completion(temperature=-0.5)),
    ("temperature-huge", C, completion(temperature=1e308)),
    ("top-p-over-one", C, completion(top_p=1.5)),
    ("top-p-negative", C, completion(top_p=-0.1)),
    ("top-k-negative", C, completion(top_k=-5)),
    ("top-k-string", C, completion(top_k="5")),
    ("seed-string", C, completion(seed="42")),
    ("seed-float", C, completion(seed=4.2)),
    ("stream-string", C, completion(stream="yes")),
    ("stream-options-string", C, completion(stream=True, stream_options="usage")),
    ("include-usage-number", C, completion(stream=True, stream_options={"include_usage": 1})),
    ("n-zero", C, completion(n=0)),
    ("n-17", C, completion(n=17)),
    ("n-string", H, chat(n="2")),
    ("logprobs-21", C, completion(logprobs=21)),
    ("logprobs-negative", C, completion(logprobs=-1)),
    ("chat-logprobs-number", H, chat(logprobs=2)),
    ("chat-top-logprobs-21", H, chat(logprobs=True, top_logprobs=21)),
    ("chat-top-logprobs-without-logprobs", H, chat(top_logprobs=2)),
    ("stop-number", C, completion(stop=5)),
    ("stop-empty-string", C, completion(stop="")),
    ("stop-too-many", C, completion(stop=["a", "b", "c", "d", "e"])),
    ("stop-list-of-lists", C, completion(stop=[["a"]])),
    ("priority-unknown", C, completion(priority="urgent")),
    ("failover-unknown", C, completion(failover="retry")),
    ("timeout-negative", C, completion(timeout=-1)),
    ("timeout-string", C, completion(timeout="5s")),
    ("user-number", C, completion(user=7)),
    ("presence-penalty-out-of-range", C, completion(presence_penalty=2.5)),
    ("max-tokens-zero-without-echo", C, completion(max_tokens=0)),
    ("response-format-unknown", H, chat(response_format={"type": "yaml"})),
    ("audio-output", H, chat(audio={"voice": "alloy"})),
    ("tools-bad-name", H, chat(tools=[{"type": "function", "function": {"name": "a b"}}])),
    ("messages-missing", H, {"model": MODEL}),
    ("messages-empty", H, chat(messages=[])),
    ("messages-string", H, chat(messages="hi")),
    ("messages-item-string", H, chat(messages=["hi"])),
    ("message-empty-object", H, chat(messages=[{}])),
    ("message-role-unknown", H, chat(messages=[{"role": "wizard", "content": "x"}])),
    ("message-role-number", H, chat(messages=[{"role": 1, "content": "x"}])),
    ("message-role-missing", H, chat(messages=[{"content": "x"}])),
    ("message-content-missing", H, chat(messages=[{"role": "user"}])),
    ("message-content-number", H, chat(messages=[{"role": "user", "content": 5}])),
    ("message-content-bad-part", H, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])),
    ("message-content-part-not-object", H, chat(messages=[{"role": "user",
                                                          "content": ["x"]}])),
]


@pytest.mark.parametrize(("path", "body"), [pytest.param(p, b, id=i) for i, p, b in BAD])
async def test_malformed_input_gets_4xx_in_openai_shape(server: Server,
                                                       session: aiohttp.ClientSession,
                                                       path: str, body: Any) -> None:
    kw: dict[str, Any] = ({"data": body, "headers": {"Content-Type": "application/json"}}
                          if isinstance(body, bytes) else {"json": body})
    async with session.post(server.url + path, **kw) as resp:
        text = await resp.text()
        assert 400 <= resp.status < 500, (resp.status, text)
        assert resp.headers.get("X-Request-Id"), "errors carry X-Request-Id too"
        assert resp.content_type == "application/json"
        err = assert_error_shape(orjson.loads(text))
    assert "Traceback" not in err["message"]
    await assert_serves(session, server.url)


GOOD: list[tuple[str, str, Any]] = [
    # Odd but valid: these must be served, not refused and never a 5xx.
    ("prompt-control-chars", C, completion(prompt="\x00\x01\x07\x1b[31m\x7f\r\n\t")),
    ("prompt-unicode", C, completion(prompt="naïve 日本語 🙂 \u202e \ufeff \U0010ffff")),
    ("chat-control-chars", H, chat(messages=[{"role": "user", "content": "\x00\x1b\x7f"}])),
    ("chat-unicode", H, chat(messages=[{"role": "system", "content": "Ω≈ç√"},
                                       {"role": "user", "content": "👋🏽 ʕ•ᴥ•ʔ"}])),
    ("chat-text-parts", H, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])),
    ("prompt-token-ids", C, completion(prompt=[1, 2, VOCAB - 1])),
    ("prompt-batch", C, completion(prompt=["one", "two"])),
    ("stop-unicode", C, completion(stop=["🙂", "\x00"])),
    ("top-k-minus-one", C, completion(top_k=-1)),
    ("seed-negative", C, completion(seed=-1, temperature=1.0)),
    ("seed-large", C, completion(seed=2**63 - 1, temperature=1.0)),
    ("temperature-zero", C, completion(temperature=0)),
    ("n-16", C, completion(n=16, max_tokens=1)),
    ("logprobs-5", C, completion(logprobs=5)),
    ("unknown-extra-field", C, completion(frobnicate={"a": [1]})),
]


@pytest.mark.parametrize(("path", "body"), [pytest.param(p, b, id=i) for i, p, b in GOOD])
async def test_odd_but_valid_input_is_served(server: Server, session: aiohttp.ClientSession,
                                             path: str, body: Any) -> None:
    async with session.post(server.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    assert out["choices"] and all(c["finish_reason"] in ("length", "stop")
                                  for c in out["choices"])


async def test_ten_megabyte_body_is_413(server: Server, session: aiohttp.ClientSession) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"a" * (10 * 2**20) + b'"}'
    async with session.post(server.url + C, data=big,
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413
        assert_error_shape(await resp.json())
        assert resp.headers.get("X-Request-Id")
    await assert_serves(session, server.url)


async def test_chunked_body_over_the_limit_is_413(server: Server,
                                                  session: aiohttp.ClientSession) -> None:
    # No Content-Length: the limit must hold while the body is read, not only from the header.
    async def chunks() -> Any:
        piece = b"a" * 2**20
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(6):
            yield piece
        yield b'"}'

    async with session.post(server.url + C, data=chunks(),
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413
        assert_error_shape(await resp.json())
    await assert_serves(session, server.url)


async def test_compressed_body_over_the_limit_is_413(server: Server,
                                                     session: aiohttp.ClientSession) -> None:
    # 20 KiB on the wire, 20 MiB inflated: the limit applies to what the server would hold.
    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"a" * (20 * 2**20) + b'"}')
    async with session.post(server.url + C, data=bomb, headers={
            "Content-Type": "application/json", "Content-Encoding": "gzip"}) as resp:
        assert resp.status == 413
        assert_error_shape(await resp.json())
    await assert_serves(session, server.url)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_undecodable_body_is_400(server: Server, session: aiohttp.ClientSession,
                                       encoding: str) -> None:
    async with session.post(server.url + C, data=b"not compressed at all", headers={
            "Content-Type": "application/json", "Content-Encoding": encoding}) as resp:
        assert resp.status == 400, await resp.text()
        assert assert_error_shape(await resp.json())["code"] == "invalid_body"
    await assert_serves(session, server.url)


async def test_unknown_route_and_wrong_method(server: Server,
                                              session: aiohttp.ClientSession) -> None:
    async with session.get(server.url + "/v1/nope") as resp:
        assert resp.status == 404
        assert_error_shape(await resp.json())
        assert resp.headers.get("X-Request-Id")
    async with session.get(server.url + C) as resp:
        assert resp.status == 405
        assert_error_shape(await resp.json())
        assert resp.headers.get("X-Request-Id")
        assert resp.headers.get("Allow") == "POST"
    async with session.delete(server.url + "/v1/requests/no-such-id") as resp:
        assert resp.status == 404
        assert_error_shape(await resp.json())
    async with session.get(server.url + "/v1/embeddings") as resp:
        assert resp.status == 405
    await assert_serves(session, server.url)


async def test_context_overflow_names_the_limit(server: Server,
                                                session: aiohttp.ClientSession) -> None:
    async with session.post(server.url + C, json=completion(max_tokens=4096)) as resp:
        assert resp.status == 400
        err = assert_error_shape(await resp.json())
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]


# -- responses, request IDs and piggybacked state ----------------------------------------------

async def test_health_ready_state_probe_models(server: Server,
                                               session: aiohttp.ClientSession) -> None:
    async with session.get(server.url + "/health", headers=FLEET) as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"
        replica_state(resp)
    async with session.get(server.url + "/ready", headers=FLEET) as resp:
        assert resp.status == 200
        replica_state(resp)
    async with session.get(server.url + "/v1/state", headers=FLEET) as resp:
        assert resp.status == 200
        st = await resp.json()
        replica_state(resp)
    assert {"free_blocks", "total_blocks", "block_size", "running", "waiting", "version",
            "draining", "healthy"} <= set(st)
    assert st["total_blocks"] == 256 and st["block_size"] == 16
    assert st["healthy"] is True and st["draining"] is False and st["version"] == "v1"
    async with session.post(server.url + "/v1/probe") as resp:
        assert resp.status == 401  # an operator's tool, not a tenant's
    async with session.post(server.url + "/v1/probe",
                            headers={"Authorization": f"Bearer {PROBE_KEY}", **FLEET}
                            ) as resp:
        assert resp.status == 200
        body = await resp.json()
        replica_state(resp)
    assert body["ok"] is True and body["latency_ms"] >= 0
    async with session.get(server.url + "/v1/models", headers=FLEET) as resp:
        assert resp.status == 200
        models = await resp.json()
        replica_state(resp)
    assert [m["id"] for m in models["data"]] == [MODEL]


async def test_every_response_carries_request_id_and_state(server: Server,
                                                           session: aiohttp.ClientSession
                                                           ) -> None:
    async with session.post(server.url + C, json=completion(), headers=FLEET) as resp:
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
        body = await resp.json()
        replica_state(resp)
    assert body["id"].endswith(rid)
    async with session.post(server.url + C, json=completion(model="nope"),
                            headers=FLEET) as resp:
        assert resp.status == 400
        assert resp.headers["X-Request-Id"]
        replica_state(resp)
    async with session.get(server.url + "/metrics", headers=FLEET) as resp:
        assert resp.headers["X-Request-Id"]
        replica_state(resp)
    async with session.post(server.url + C, json=completion(stream=True),
                            headers=FLEET) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"]
        # A stream's headers leave with its first token and say so: this request is running.
        assert replica_state(resp)["running"] >= 1
        events = [ev async for ev in sse_events(resp)]
    assert events[-1] == DONE
    # Without the fleet key (`X-Fleet-Key`, as the router sends it) no state rides along.
    async with session.post(server.url + C, json=completion()) as resp:
        assert resp.status == 200 and "X-Replica-State" not in resp.headers


async def test_client_request_id_is_echoed_and_refused_while_in_flight(
        server: Server, session: aiohttp.ClientSession) -> None:
    rid = "client-id-1"
    headers = {"X-Request-Id": rid}
    async with session.post(server.url + C, json=completion(), headers=headers) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == rid
    async with session.post(server.url + C, json=completion(model="x"), headers=headers) as resp:
        assert resp.status == 400 and resp.headers["X-Request-Id"] == rid
    async with session.post(server.url + C, json=completion(max_tokens=LONG, ignore_eos=True,
                                                            stream=True),
                            headers=headers) as first:
        assert first.status == 200 and first.headers["X-Request-Id"] == rid
        await first.content.readline()  # the request is running now
        async with session.post(server.url + C, json=completion(), headers=headers) as dup:
            assert dup.status == 409
            assert dup.headers["X-Request-Id"] == rid
            assert assert_error_shape(await dup.json())["code"] == "duplicate_request_id"
        first.close()
    await wait_idle(session, server.url)
    # Finished (or cancelled) IDs may be reused: a client retry.
    async with session.post(server.url + C, json=completion(), headers=headers) as resp:
        assert resp.status == 200
    async with session.post(server.url + C, json=completion(),
                            headers={"X-Request-Id": "bad id with spaces"}) as resp:
        assert resp.status == 400
        assert_error_shape(await resp.json())


async def test_request_id_reused_right_after_a_disconnect_is_never_a_400(
        server: Server, session: aiohttp.ClientSession) -> None:
    # A retry with the same ID can arrive before the engine has applied the first attempt's
    # abort (at its next step): that is a conflict to retry, not an invalid request.
    for attempt in range(5):
        headers = {"X-Request-Id": f"retry-after-disconnect-{attempt}"}
        first = await session.post(server.url + C, headers=headers, json=completion(
            prompt="hi " * 300, max_tokens=LONG, ignore_eos=True, stream=True))
        assert first.status == 200
        await first.content.readline()
        first.close()
        async with session.post(server.url + C, json=completion(), headers=headers) as retry:
            assert retry.status in (200, 409), await retry.text()
            if retry.status == 409:
                assert int(retry.headers["Retry-After"]) >= 1
        await wait_idle(session, server.url)
        async with session.post(server.url + C, json=completion(), headers=headers) as retry:
            assert retry.status == 200


# -- disconnects free the KV cache ---------------------------------------------------------------

async def test_disconnect_mid_stream_frees_every_block(server: Server,
                                                       session: aiohttp.ClientSession) -> None:
    await wait_idle(session, server.url)
    body = completion(prompt="A long story about batching. " * 20, max_tokens=LONG,
                      ignore_eos=True, stream=True)
    resp = await session.post(server.url + C, json=body)
    assert resp.status == 200
    seen = 0
    async for ev in sse_events(resp):
        assert ev != DONE and ev["choices"][0]["finish_reason"] is None
        seen += 1
        if seen == 5:
            break
    st = await get_state(session, server.url)
    assert st["running"] == 1 and st["free_blocks"] < st["total_blocks"]
    resp.close()  # drops the connection mid-stream
    await wait_idle(session, server.url, within=1.0)


async def test_chat_disconnect_with_n_choices_frees_every_block(
        server: Server, session: aiohttp.ClientSession) -> None:
    body = chat(max_tokens=LONG // 3, ignore_eos=True, stream=True, n=3)
    resp = await session.post(server.url + H, json=body)
    assert resp.status == 200
    await wait_state(session, server.url, lambda st: st["running"] == 3)
    resp.close()
    await wait_idle(session, server.url, within=1.0)


async def test_non_streaming_client_timeout_frees_every_block(server: Server) -> None:
    body = completion(max_tokens=LONG, ignore_eos=True)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(server.url + C, json=body,
                              timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
                await resp.read()
        await wait_idle(s, server.url, within=1.0)


async def test_request_deadline_is_504(server: Server, session: aiohttp.ClientSession) -> None:
    body = completion(max_tokens=LONG, ignore_eos=True, timeout=0.2)
    async with session.post(server.url + C, json=body) as resp:
        assert resp.status == 504
        assert assert_error_shape(await resp.json())["code"] == "deadline_exceeded"
    await wait_idle(session, server.url)


async def test_stream_deadline_ends_with_an_error_event(server: Server,
                                                        session: aiohttp.ClientSession) -> None:
    body = completion(max_tokens=LONG, ignore_eos=True, stream=True, timeout=0.3)
    async with session.post(server.url + C, json=body) as resp:
        assert resp.status == 200
        events = [ev async for ev in sse_events(resp)]
    assert events[-1] == DONE
    assert assert_error_shape(events[-2])["code"] == "deadline_exceeded"
    await wait_idle(session, server.url)


# -- metrics -------------------------------------------------------------------------------------

METRIC_NAMES = {
    "batcher_ttft_seconds", "batcher_tpot_seconds", "batcher_queue_wait_seconds",
    "batcher_service_seconds", "batcher_e2e_seconds", "batcher_batch_size",
    "batcher_cancel_delay_seconds", "batcher_kv_blocks_used", "batcher_kv_blocks_total",
    "batcher_running", "batcher_waiting", "batcher_prompt_tokens", "batcher_generated_tokens",
    "batcher_prefill_tokens_computed", "batcher_prefix_cache_hit_tokens", "batcher_preemptions",
    "batcher_requests_finished", "batcher_requests_rejected", "batcher_goodput_requests",
}
# The router retries and fails over; a replica does neither and exports no such series.
ROUTER_ONLY = {"batcher_retries", "batcher_failovers"}


async def test_metrics_parse_with_prometheus_parser(server: Server,
                                                    session: aiohttp.ClientSession) -> None:
    async with session.post(server.url + C, json=completion(max_tokens=8, ignore_eos=True)
                            ) as resp:
        assert resp.status == 200
    async with session.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert METRIC_NAMES <= set(families), sorted(METRIC_NAMES - set(families))
    assert not ROUTER_ONLY & set(families)
    ttft = {s.name: s.value for s in families["batcher_ttft_seconds"].samples}
    assert ttft["batcher_ttft_seconds_count"] >= 1
    finished = [s for s in families["batcher_requests_finished"].samples
                if s.name.endswith("_total")]
    assert any(s.labels.get("reason") == "length" and s.value >= 1 for s in finished)
    assert families["batcher_kv_blocks_total"].samples[0].value == 256
    assert families["batcher_goodput_requests"].type == "counter"


# -- shutdown ------------------------------------------------------------------------------------

@pytest.mark.slow
async def test_sigterm_drain_loses_no_in_flight_request() -> None:
    streams = 3
    max_tokens = 600  # about a second at batch 3: SIGTERM lands a few steps in
    with serve(num_blocks=512, shutdown_timeout=30) as srv:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            body = completion(max_tokens=max_tokens, ignore_eos=True, stream=True,
                              stream_options={"include_usage": True})
            whole = asyncio.create_task(s.post(srv.url + C, json=completion(
                max_tokens=max_tokens, ignore_eos=True)))
            resps = [await s.post(srv.url + C, json=body) for _ in range(streams)]
            iters = [sse_events(r) for r in resps]
            for r, it in zip(resps, iters, strict=True):
                assert r.status == 200
                await anext(it)  # each stream is running
            srv.proc.send_signal(signal.SIGTERM)
            st = await wait_state(s, srv.url, lambda st: st["draining"], within=5)
            # The streams are still running: the drain has real work to wait for.
            assert st["running"] == streams + 1, st
            try:
                async with s.post(srv.url + C, json=completion()) as late:
                    assert late.status == 503, await late.text()
                    assert int(late.headers["Retry-After"]) >= 1
                    assert_error_shape(await late.json())
                async with s.get(srv.url + "/ready") as ready:
                    assert ready.status == 503
            except aiohttp.ClientConnectionError:
                pass  # the listener already closed: also a refusal
            for it in iters:
                events = [ev async for ev in it]
                assert events[-1] == DONE
                finals = [ev for ev in events[:-1] if ev["choices"]]
                assert not any("error" in ev for ev in events[:-1]), events[-3:]
                assert finals[-1]["choices"][0]["finish_reason"] == "length"
                assert events[-2]["usage"]["completion_tokens"] == max_tokens
            async with await whole as resp:
                assert resp.status == 200
                out = await resp.json()
            assert out["choices"][0]["finish_reason"] == "length"
            assert out["usage"]["completion_tokens"] == max_tokens
            for r in resps:
                r.close()
        rc = await asyncio.to_thread(srv.proc.wait, 30)
        assert rc == 0, srv.log()


@pytest.mark.slow
async def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error() -> None:
    with serve(num_blocks=512, shutdown_timeout=1) as srv:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            body = completion(max_tokens=LONG, ignore_eos=True, stream=True)
            resps = [await s.post(srv.url + C, json=body) for _ in range(2)]
            iters = [sse_events(r) for r in resps]
            for it in iters:
                await anext(it)
            t0 = asyncio.get_running_loop().time()
            srv.proc.send_signal(signal.SIGTERM)
            for it in iters:
                events = [ev async for ev in it]
                # Never a silent truncation: an explicit error, then [DONE].
                assert events[-1] == DONE
                assert "error" in events[-2], events[-3:]
                assert "shut down" in events[-2]["error"]["message"]
            assert asyncio.get_running_loop().time() - t0 < 10
            for r in resps:
                r.close()
        rc = await asyncio.to_thread(srv.proc.wait, 30)
        assert rc == 0, srv.log()


# -- the command line ----------------------------------------------------------------------------

SERVE_FLAGS = ["--model", "--host", "--port", "--dtype", "--kv-cache-memory", "--max-num-seqs",
               "--max-num-batched-tokens", "--tenants", "--admin-port", "--slo-ttft-ms",
               "--slo-tpot-ms", "--shutdown-timeout"]


def test_serve_help_documents_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "batcher.app.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in SERVE_FLAGS:
        assert flag in out, flag
    import argparse

    from batcher.app.serve_flags import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for flag, action in actions.items():
        if flag == "-h":
            continue
        if action.help == argparse.SUPPRESS:
            # Test-only switches (fault injection) are hidden from operators' help on purpose.
            assert flag.startswith("--fake-fault"), f"{flag} is hidden from --help"
            continue
        assert action.help, f"{flag} has no help text"
        assert flag in out, flag
    for flag in SERVE_FLAGS:
        # Each names its default (or says what happens without it).
        text = actions[flag].help or ""
        assert "default" in text or "unless given" in text, (flag, text)
