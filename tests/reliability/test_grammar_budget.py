"""A grammar too ambiguous to follow cheaply cannot slow other tenants down: its requests are cut
with a clear error once their masks cost more than the budget.

Pass figures: while 4 streams follow a 60-byte ambiguous grammar (200 tokens, `ignore_eos`),
another tenant's plain 64-token completion takes at most twice what it takes alone (plus 0.1 s
for a shared machine's jitter; about 12 s before the budget, against 0.1 s alone), and a
JSON-schema request of a third kind finishes normally; every grammar stream ends with an error
event saying the grammar is too costly (`grammar_too_costly`), then `[DONE]`, within 20 s; then
the cut tenant's next constrained request is refused for a cool-down (429 `grammar_cooldown`),
its plain ones and the other tenant's constrained ones are served.

One tiny-model replica with two tenants on 127.0.0.1, started and stopped by this module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.server_process import DONE, Server, server_fixture, sse_events, write_tenants

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(120)]

TAG = uuid.uuid4().hex[:12]
ALICE = {"Authorization": f"Bearer alice-grammar-{TAG}"}
BOB = {"Authorization": f"Bearer bob-grammar-{TAG}"}
AMBIGUOUS = 'start: e\ne: e e | e "+" e | "(" e ")" | /[a-z]+/ | " "\n'


def _setup(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(Path(tmp.mktemp("grammar")) / "tenants.toml", {
        "alice": {"key": f"alice-grammar-{TAG}", "tokens_per_minute": 1e9, "max_concurrent": 16},
        "bob": {"key": f"bob-grammar-{TAG}", "tokens_per_minute": 1e9, "max_concurrent": 16}})
    return ["--tenants", str(path)]


server = server_fixture(setup=_setup)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def _grammar_stream(session: aiohttp.ClientSession, url: str) -> list:
    body = {"prompt": "expression:", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "guided_grammar": AMBIGUOUS}
    async with session.post(url + "/v1/completions", json=body, headers=ALICE) as resp:
        if resp.status != 200:
            return [resp.status, await resp.json()]
        return [e async for e in sse_events(resp)]


async def _timed(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, dict]:
    start = time.monotonic()
    async with session.post(url + "/v1/completions", json=body, headers=BOB) as resp:
        out = await resp.json()
        assert resp.status == 200, out
    return time.monotonic() - start, out


async def test_ambiguous_grammar_is_cut_and_others_keep_their_pace(
        server: Server, session: aiohttp.ClientSession) -> None:
    plain = {"prompt": "hello", "max_tokens": 64, "ignore_eos": True}
    await _timed(session, server.url, plain)  # warm
    alone = sorted([(await _timed(session, server.url, plain))[0] for _ in range(3)])[1]
    start = time.monotonic()
    streams = [asyncio.create_task(_grammar_stream(session, server.url)) for _ in range(4)]
    await asyncio.sleep(0.5)  # the grammar rows are stepping
    took, _ = await _timed(session, server.url, plain)
    _, schema = await _timed(session, server.url, {
        "prompt": "a person:", "max_tokens": 24, "guided_json": {
            "type": "object", "properties": {"name": {"type": "string"}}}})
    results = await asyncio.gather(*streams)
    assert time.monotonic() - start < 20
    assert took <= 2 * alone + 0.1, (
        f"a plain 64-token request took {took:.2f} s beside the grammar streams, {alone:.2f} s "
        "alone")
    assert schema["choices"][0]["finish_reason"] in ("stop", "length"), schema
    for events in results:
        assert events and events[-1] == DONE, events[-3:]
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["code"] == "grammar_too_costly", events[-3:]
        assert "too costly" in errors[0]["message"]
    # Cut once, alice's next constrained request waits out a cool-down (her plain ones do not);
    # bob's constrained requests are served as before.
    schema_body = {"prompt": "a person:", "max_tokens": 8, "guided_json": {
        "type": "object", "properties": {"name": {"type": "string"}}}}
    async with session.post(server.url + "/v1/completions", json=schema_body,
                            headers=ALICE) as resp:
        refused = await resp.json()
        assert resp.status == 429, refused
        assert refused["error"]["code"] == "grammar_cooldown"
        assert 1 <= int(resp.headers["Retry-After"]) <= 10
    async with session.post(server.url + "/v1/completions", json=plain, headers=ALICE) as resp:
        assert resp.status == 200, await resp.text()
    _, again = await _timed(session, server.url, schema_body)
    assert again["choices"][0]["finish_reason"] in ("stop", "length"), again
