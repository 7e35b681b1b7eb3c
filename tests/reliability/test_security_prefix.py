"""Tenants share nothing through the prefix cache: the secret-guess attack.

Alice sends a prompt holding a secret. Bob and Carol guess it: were cache blocks shared across
tenants, a right guess would come back with `cached_tokens` > 0 (and a faster first token) and a
wrong one with 0, so an attacker learns Alice's secret one guess at a time. With the default scope
(`--prefix-cache-scope tenant`) both guesses show 0 while Alice's own repeat still hits. The same
attack against `--prefix-cache-scope global` succeeds, which shows the test can tell.

On the bundled model (SmolLM2) at default settings; the global-scope counterpart on the fake
model, which shares the real scheduler and block pool.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.server_process import serve, write_tenants

pytestmark = pytest.mark.slow

TAG = uuid.uuid4().hex[:8]
ALICE = {"Authorization": f"Bearer alice-prefix-{TAG}"}
BOB = {"Authorization": f"Bearer bob-prefix-{TAG}"}
CAROL = {"Authorization": f"Bearer carol-prefix-{TAG}"}
# The secret comes first, so a wrong guess shares no block with it; the rest makes several full
# KV blocks that a right guess would hit.
NOTE = (" Internal note for the operator on duty tonight, not to be shared with customers under "
        "any circumstances whatsoever. Please confirm that you have read this note in full.")


def secret_prompt(code: str) -> str:
    return f"Vault code {code}." + NOTE


def tenants(tmp: Path) -> list[str]:
    path = write_tenants(tmp / "tenants.toml", {
        "alice": {"key": ALICE["Authorization"].split()[1], "tokens_per_minute": 1e7,
                  "max_concurrent": 8},
        "bob": {"key": BOB["Authorization"].split()[1], "tokens_per_minute": 1e7,
                "max_concurrent": 8},
        "carol": {"key": CAROL["Authorization"].split()[1], "tokens_per_minute": 1e7,
                  "max_concurrent": 8}})
    return ["--tenants", str(path)]


async def cached(session: aiohttp.ClientSession, url: str, model: str, headers: dict[str, str],
                 prompt: str) -> int:
    async with session.post(url + "/v1/completions", headers=headers, json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def guesses(url: str, model: str) -> tuple[int, int, int]:
    """(Alice's own repeat, a right guess, a wrong guess): cached tokens of each. Each guess is
    its attacker's first request (an attacker's own earlier guesses are its own cache)."""
    async with aiohttp.ClientSession() as s:
        assert await cached(s, url, model, ALICE, secret_prompt("4812")) == 0
        own = await cached(s, url, model, ALICE, secret_prompt("4812"))
        right = await cached(s, url, model, BOB, secret_prompt("4812"))
        wrong = await cached(s, url, model, CAROL, secret_prompt("7730"))
    return own, right, wrong


@pytest.mark.timeout(240)
async def test_the_secret_guess_fails_on_the_real_model(tmp_path: Path) -> None:
    with serve("--model", "smollm2-135m", *tenants(tmp_path), num_blocks=None) as server:
        own, right, wrong = await guesses(server.url, "smollm2-135m")
    print(f"tenant scope (SmolLM2): alice's repeat {own} cached tokens; bob's right guess "
          f"{right}, wrong guess {wrong}")
    assert own >= 32  # the cache works within a tenant
    assert right == wrong == 0


@pytest.mark.timeout(120)
async def test_the_secret_guess_works_when_the_operator_shares_the_cache(tmp_path: Path
                                                                         ) -> None:
    with serve("--model", "fake", "--prefix-cache-scope", "global",
               *tenants(tmp_path)) as server:
        own, right, wrong = await guesses(server.url, "fake")
    print(f"global scope (fake model): alice's repeat {own}; bob's right guess {right}, "
          f"wrong guess {wrong}")
    assert right >= 32 and wrong == 0
