"""Deeply nested JSON, huge numbers and hostile upload filenames get 400s in OpenAI's shape from
replica and router alike, never a 500 or a traceback.

Pass figures: every case below answers 400 with `{"error": {...}}` and an `X-Request-Id`, on the
replica and through a router, within 5 s; nothing is logged as a traceback by either; a file
uploaded under a non-UTF-8 name is listed afterwards with a printable name.

One tiny-model replica with the batch API (`--data-dir`) and a router in front of it, on
127.0.0.1, started and stopped by this module.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.fleet.procs import Proc, router, running, wait_http
from tests.server_process import Server, assert_error_shape, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _nest(depth: int, kind: str = "list") -> str:
    """JSON text nested `depth` deep (written by hand: encoders stop far earlier)."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + '{"type":"object"}' + "}" * depth


def _chat(extra: str = "", content: str = '"hi"') -> str:
    return ('{"messages":[{"role":"user","content":' + content + '}],"max_tokens":2'
            + extra + "}")


DEEP_ARGS = json.dumps("[" * 5000 + "]" * 5000)
CASES: list[tuple[str, str, str]] = [
    ("tool-call arguments nested 5,000 deep", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,'
     '"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":'
     + DEEP_ARGS + '}}]},{"role":"tool","tool_call_id":"c1","content":"x"}],"max_tokens":2}'),
    ("guided_json as a string nested 2,000 deep", "/v1/completions",
     '{"prompt":"hi","max_tokens":2,"guided_json":' + json.dumps(_nest(2000)) + "}"),
    ("guided_json object nested 1,000 deep", "/v1/completions",
     '{"prompt":"hi","max_tokens":2,"guided_json":' + _nest(1000, "object") + "}"),
    ("message content nested 1,000 deep", "/v1/chat/completions",
     _chat(content=_nest(1000))),
    ("tool parameters.default nested 1,000 deep", "/v1/chat/completions",
     _chat(',"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",'
           '"properties":{"x":{"type":"array","default":' + _nest(1000) + "}}}}}]")),
    ("a 5,000-digit logit_bias key", "/v1/completions",
     '{"prompt":"hi","max_tokens":2,"logit_bias":{"' + "5" * 5000 + '":1}}'),
]
BAD_NAMES = [b"a\r\nb.jsonl", b"x" * 9000]
LINE = (b'{"custom_id":"a","method":"POST","url":"/v1/completions",'
        b'"body":{"prompt":"hi","max_tokens":1}}\n')


def _upload(filename: bytes, content: bytes = LINE) -> bytes:
    return (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
            b'Content-Disposition: form-data; name="file"; filename="' + filename
            + b'"\r\nContent-Type: application/jsonl\r\n\r\n' + content + b"\r\n--B--\r\n")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Proc]]:
    data = Path(tmp_path_factory.mktemp("depth-data"))
    with serve("--data-dir", str(data)) as rep:
        rt = router("--log-level", "info", replicas=(rep.url,))
        with running(rt):
            wait_http(rt.url + "/ready", procs=(rt,))
            yield rep, rt
            assert "Traceback" not in rt.tail(200_000), rt.tail()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s


async def _expect_400(session: aiohttp.ClientSession, method: str, url: str, what: str,
                      data: bytes | None = None, content_type: str = "application/json"
                      ) -> None:
    start = time.monotonic()
    async with session.request(method, url, data=data,
                               headers={"Content-Type": content_type}) as resp:
        raw = await resp.read()
        assert resp.status == 400, (what, url, resp.status, raw[:300])
        assert resp.content_type == "application/json", (what, raw[:300])
        assert resp.headers.get("X-Request-Id"), what
        assert_error_shape(json.loads(raw))
        assert len(raw) < 2000, (what, len(raw))
    assert time.monotonic() - start < 5.0, what


async def test_deep_json_and_huge_numbers_are_400(fleet: tuple[Server, Proc],
                                                  session: aiohttp.ClientSession) -> None:
    for base in (fleet[0].url, fleet[1].url):
        for what, path, body in CASES:
            await _expect_400(session, "POST", base + path, what, body.encode())
        for path in ("/v1/files", "/v1/batches"):
            await _expect_400(session, "GET", f"{base}{path}?limit={'5' * 5000}",
                              f"{path} limit of 5,000 digits")


async def test_hostile_upload_filenames(fleet: tuple[Server, Proc],
                                        session: aiohttp.ClientSession) -> None:
    multipart = "multipart/form-data; boundary=B"
    for base in (fleet[0].url, fleet[1].url):
        for name in BAD_NAMES:
            await _expect_400(session, "POST", base + "/v1/files", f"filename {name[:12]!r}",
                              _upload(name), multipart)
    async with session.post(fleet[0].url + "/v1/files", data=_upload(b"\xff\xfe.jsonl"),
                            headers={"Content-Type": multipart}) as resp:
        assert resp.status == 200, await resp.text()
        name = (await resp.json())["filename"]
    assert name.isprintable(), name
    for base in (fleet[0].url, fleet[1].url):
        async with session.get(base + "/v1/files") as resp:
            assert resp.status == 200, await resp.text()
            names = [f["filename"] for f in (await resp.json())["data"]]
        assert name in names and all(n.isprintable() for n in names), names


def test_malformed_cool_down_starts_at_a_flood_rate_only() -> None:
    """`THRESHOLD` refusals within `WINDOW_S` start the cool-down; as many spread wider do not."""
    from batcher.http.errors import ApiError
    from batcher.server.malformed_cooldown import COOLDOWN_S, THRESHOLD, WINDOW_S, \
        malformed_cooldown

    now = [0.0]
    cool = malformed_cooldown(clock=lambda: now[0])
    step = 1.01 * WINDOW_S / (THRESHOLD - 1)  # the THRESHOLD-th just outside the window
    for _ in range(3 * THRESHOLD):
        cool.note("slow")
        now[0] += step
    cool.check("slow")
    for _ in range(THRESHOLD):
        cool.note("flood")
        now[0] += 0.5 * WINDOW_S / THRESHOLD
    with pytest.raises(ApiError) as e:
        cool.check("flood")
    assert (e.value.status, e.value.code) == (429, "malformed_cooldown")
    assert e.value.hold_s > 0 and e.value.headers.get("Connection") == "close"
    cool.check("slow")  # another tenant is not held
    now[0] += COOLDOWN_S
    cool.check("flood")  # the cool-down is over


def test_only_malformed_refusals_count_towards_the_cool_down() -> None:
    """A prompt too long for the context, an unknown model: refused, but not malformed; a
    tenant sending many of them is not cooled down for it."""
    from types import SimpleNamespace

    from batcher.http.errors import ApiError
    from batcher.server.gateway import Gateway
    from batcher.server.malformed_cooldown import malformed_cooldown

    class Req(dict):
        remote = "10.0.0.9"

    gw = SimpleNamespace(malformed_cooldown=malformed_cooldown(threshold=3, window_s=60),
                         oversize_cooldown=malformed_cooldown(threshold=10**9, window_s=1))
    request = Req(tenant=SimpleNamespace(name="alice"))
    for code in ("context_length_exceeded", "model_not_found", "duplicate_request_id") * 3:
        Gateway.note_refusal(gw, request, ApiError(400, "no", code=code))  # type: ignore[arg-type]
    gw.malformed_cooldown.check("alice")
    malformed = ApiError(400, "no", code="invalid_json")
    for _ in range(3):
        Gateway.note_refusal(gw, request, malformed)  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        gw.malformed_cooldown.check("alice")
