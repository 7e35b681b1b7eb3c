"""Prompts that cannot fit are refused before they are tokenized, and tokenizer work never starves
the event loop.

Pass figures: four concurrent 4-million-character prompts (`max_tokens: 1`) and four 4 MB
`/tokenize` calls with `return_token_strs` are each refused 400 `context_length_exceeded` (or,
once one of them was, 429 `oversize_cooldown` before the body is read) within 2 s, while `GET /health` keeps answering within 0.5 s; a tenant at its concurrency limit cannot
queue more tokenizer work; a normal request is served afterwards.

One tiny-model replica with two tenants on 127.0.0.1, started and stopped by this module.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.server_process import Server, assert_error_shape, server_fixture, write_tenants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TAG = uuid.uuid4().hex[:12]
ALICE = {"Authorization": f"Bearer alice-bounds-{TAG}"}
# One tenant per check of huge bodies: a tenant refused one starts a cool-down for the next.
BOB, CAROL, DAVE, ERIN = ({"Authorization": f"Bearer {name}-bounds-{TAG}"}
                          for name in ("bob", "carol", "dave", "erin"))
HUGE = "a " * 2_000_000  # 4 MB: far more than any context, seconds of tokenizer time
BODY_LIMIT = 8 * 2**20


def _setup(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(Path(tmp.mktemp("bounds")) / "tenants.toml", {
        "alice": {"key": f"alice-bounds-{TAG}", "tokens_per_minute": 1e9, "max_concurrent": 2},
        **{name: {"key": f"{name}-bounds-{TAG}", "tokens_per_minute": 1e9, "max_concurrent": 16}
           for name in ("bob", "carol", "dave", "erin")}})
    return ["--tenants", str(path), "--max-body-bytes", str(BODY_LIMIT)]


server = server_fixture(setup=_setup)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def _post(session: aiohttp.ClientSession, url: str, body: bytes,
                headers: dict[str, str]) -> tuple[int, dict, float]:
    start = time.monotonic()
    async with session.post(url, data=body, headers={
            **headers, "Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(), time.monotonic() - start


async def _health_worst(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        start = time.monotonic()
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        worst = max(worst, time.monotonic() - start)
        await asyncio.sleep(0.05)
    return worst


async def _refused_at_once(session: aiohttp.ClientSession, server: Server, path: str,
                           body: dict, headers: dict[str, str]) -> None:
    raw = orjson.dumps(body)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_health_worst(session, server.url, stop))
    try:
        answers = await asyncio.gather(*(
            _post(session, server.url + path, raw, headers) for _ in range(4)))
    finally:
        stop.set()
    worst = await watcher
    codes = [(status, assert_error_shape(payload)["code"]) for status, payload, _ in answers]
    # The first refusal reads the body; the tenant's huge bodies after it may be refused from
    # their length alone (its cool-down).
    assert (400, "context_length_exceeded") in codes, codes
    assert set(codes) <= {(400, "context_length_exceeded"), (429, "oversize_cooldown")}, codes
    for status, payload, took in answers:
        assert took < 2.0, f"{path} refused only after {took:.1f} s"
        assert len(orjson.dumps(payload)) < 1000
    assert worst < 0.5, f"/health took {worst:.2f} s while {path} ran"


async def test_huge_prompts_refused_before_tokenizing(server: Server,
                                                      session: aiohttp.ClientSession) -> None:
    await _refused_at_once(session, server, "/v1/completions",
                           {"prompt": HUGE, "max_tokens": 1}, BOB)
    await _refused_at_once(session, server, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1},
                           CAROL)
    status, payload, _ = await _post(session, server.url + "/v1/completions",
                                     orjson.dumps({"prompt": "hello", "max_tokens": 2}), BOB)
    assert status == 200, payload


async def test_tokenize_input_and_answer_bounded(server: Server,
                                                 session: aiohttp.ClientSession) -> None:
    await _refused_at_once(session, server, "/tokenize",
                           {"prompt": HUGE, "return_token_strs": True}, DAVE)
    # Short enough to pass the length check, too many tokens for the context: still refused,
    # so an answer never lists more tokens than the context holds.
    status, payload, _ = await _post(session, server.url + "/tokenize", orjson.dumps(
        {"prompt": "a " * 20_000, "return_token_strs": True}), BOB)
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    status, payload, _ = await _post(session, server.url + "/tokenize", orjson.dumps(
        {"prompt": "hello world", "return_token_strs": True}), BOB)
    assert status == 200 and payload["count"] == len(payload["token_strs"]) > 0, payload


async def test_tokenizer_work_counts_against_concurrency(server: Server,
                                                         session: aiohttp.ClientSession) -> None:
    # Alice may run 2 requests at once; tokenizing long texts (in worker threads) counts too,
    # so 8 at once cannot all be working. Each passes the length check and is refused for its
    # token count (400) once tokenized, unless refused for concurrency first (429).
    body = orjson.dumps({"prompt": "word " * 40_000})
    answers = await asyncio.gather(*(
        _post(session, server.url + "/tokenize", body, ALICE) for _ in range(8)))
    statuses = sorted(a[0] for a in answers)
    assert set(statuses) <= {400, 429}, answers
    refused = [a for a in answers if a[0] == 429]
    assert refused, f"8 concurrent tokenizer jobs all ran for a tenant limited to 2: {statuses}"
    assert refused[0][1]["error"]["code"] == "tenant_concurrency"


async def test_a_tenant_refused_a_huge_body_is_refused_the_next_before_it_is_read(
        server: Server, session: aiohttp.ClientSession) -> None:
    """After one huge body refused for its length, the tenant's next bodies over 1 MiB get 429
    `oversize_cooldown` from their Content-Length alone, with Retry-After and the connection
    closed (nothing read or drained), each held `HOLD_S` before it is sent (a client that does
    not wait is slowed to one a second); its small requests and other tenants' huge ones are
    answered as before."""
    from batcher.server.cooldown import HOLD_S

    huge = orjson.dumps({"prompt": HUGE, "max_tokens": 1})
    status, payload, _ = await _post(session, server.url + "/v1/completions", huge, ERIN)
    assert (status, payload["error"]["code"]) == (400, "context_length_exceeded"), payload
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        start = time.monotonic()
        async with session.post(server.url + path, data=huge, headers={
                **ERIN, "Content-Type": "application/json"}) as resp:
            payload = await resp.json()
            assert resp.status == 429, payload
            assert assert_error_shape(payload)["code"] == "oversize_cooldown"
            assert 1 <= int(resp.headers["Retry-After"]) <= 10
            assert resp.headers.get("Connection", "").lower() == "close"
        assert HOLD_S - 0.05 <= time.monotonic() - start < HOLD_S + 1.0
    # A compressed body is judged as sent, not as read: small on the wire, refused all the same.
    async with session.post(server.url + "/v1/messages/count_tokens", data=gzip.compress(huge),
                            headers={**ERIN, "Content-Type": "application/json",
                                     "Content-Encoding": "gzip"}) as resp:
        assert resp.status == 429, await resp.text()
    status, payload, _ = await _post(session, server.url + "/v1/completions",
                                     orjson.dumps({"prompt": "hello", "max_tokens": 2}), ERIN)
    assert status == 200, payload
    status, payload, _ = await _post(session, server.url + "/v1/completions", huge, ALICE)
    assert (status, payload["error"]["code"]) == (400, "context_length_exceeded"), payload


def test_without_tenants_of_its_own_a_cool_down_is_the_clients_alone() -> None:
    """Auth off (or `--api-key`'s one tenant for every key): the cool-downs are kept per client
    address, so one abusive client does not cool down every other; with tenants, per tenant."""
    from types import SimpleNamespace

    from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig
    from batcher.server.gateway import cooldown_key

    def request(tenant: TenantConfig, remote: str) -> SimpleNamespace:
        return SimpleNamespace(get={"tenant": tenant}.get, remote=remote)

    assert cooldown_key(request(DEFAULT_TENANT, "10.0.0.1")) == "default@10.0.0.1"
    assert cooldown_key(request(DEFAULT_TENANT, "10.0.0.2")) == "default@10.0.0.2"
    alice = TenantConfig(name="alice", tokens_per_minute=1e6, max_concurrent=4)
    assert cooldown_key(request(alice, "10.0.0.1")) == "alice"
    assert cooldown_key(request(alice, "10.0.0.2")) == "alice"
