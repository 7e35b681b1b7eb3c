"""The shared HTTP toolkit: one error shape, one request-ID rule, SSE framing, and key checks that
never raise on odd header bytes."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from batcher.http import (
    DONE,
    ApiError,
    AuthError,
    bearer_matches,
    bearer_token,
    client_request_id,
    error_body,
    from_http_exception,
    is_valid_request_id,
    json_response,
    new_request_id,
    request_id_or_new,
    single_header,
    sse_event,
)


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(list(pairs)))


def test_error_body_has_openai_shape_and_one_type_per_status() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (404, "not_found_error"), (413, "invalid_request_error"),
                         (429, "rate_limit_error"), (503, "service_unavailable"),
                         (504, "timeout_error"), (418, "api_error")):
        body = error_body(status, "m", param="p", code="c")
        assert body == {"error": {"message": "m", "type": kind, "param": "p", "code": "c"}}
        assert ApiError(status, "m", param="p", code="c").body() == body


def test_api_error_response_headers() -> None:
    resp = ApiError(429, "slow down", code="rate_limited", retry_after=0.2).response("r-1")
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "1"  # rounded up, never 0
    assert resp.headers["X-Request-Id"] == "r-1"
    assert orjson.loads(resp.body)["error"]["type"] == "rate_limit_error"
    assert ApiError(503, "x", retry_after=2.01).response().headers["Retry-After"] == "3"


def test_http_exceptions_keep_allow_and_map_413() -> None:
    err = from_http_exception(web.HTTPMethodNotAllowed("PUT", ["GET", "POST"]))
    assert err.status == 405 and err.code == "method_not_allowed"
    assert set(err.headers["Allow"].split(",")) == {"GET", "POST"}
    big = from_http_exception(web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2))
    assert (big.status, big.code) == (413, "body_too_large")
    assert from_http_exception(web.HTTPNotFound()).body()["error"]["type"] == "not_found_error"


def test_request_ids() -> None:
    ids = {new_request_id() for _ in range(200)}
    assert len(ids) == 200 and all(is_valid_request_id(i) for i in ids)
    assert client_request_id(None) is None
    assert client_request_id("abc:1.2_3-x") == "abc:1.2_3-x"
    for bad in ("", "a b", "x" * 129, "é", "a\nb", "a/b"):
        assert not is_valid_request_id(bad)
        with pytest.raises(ApiError) as e:
            client_request_id(bad)
        assert e.value.status == 400 and e.value.param == "X-Request-Id"
        assert request_id_or_new(bad).startswith("req-")
    assert request_id_or_new("keep-me") == "keep-me"


def test_sse_framing() -> None:
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_json_response() -> None:
    resp = json_response({"x": [1, 2]}, 201, headers={"X-A": "b"})
    assert resp.status == 201 and resp.content_type == "application/json"
    assert orjson.loads(resp.body) == {"x": [1, 2]} and resp.headers["X-A"] == "b"


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer k") == "k"
    assert bearer_token("  bearer   k  ") == "k"
    assert bearer_token("BEARER k") == "k"
    for bad in ("", "Bearer", "Bearer   ", "Basic k", "k"):
        assert bearer_token(bad) is None


def test_bearer_matches_never_raises_on_odd_input() -> None:
    assert bearer_matches(headers(("Authorization", "Bearer s3cret")), "s3cret")
    assert bearer_matches(headers(("authorization", "bearer s3cret")), "s3cret")
    odd = ["Bearer \udcff\udcfe", "Bearer \ud800", "Bearer s3cret\x00", "Bearer s3cre",
           "Basic s3cret", "s3cret", ""]
    for value in odd:
        assert not bearer_matches(headers(("Authorization", value)), "s3cret")
    assert not bearer_matches(headers(), "s3cret")
    # Sent twice (even both right): refused, two proxies could read different copies.
    twice = headers(("Authorization", "Bearer s3cret"), ("Authorization", "Bearer s3cret"))
    assert not bearer_matches(twice, "s3cret")
    # An empty expected key matches nothing, not even an empty credential.
    assert not bearer_matches(headers(("Authorization", "Bearer ")), "")
    # A non-ASCII key round-trips.
    assert bearer_matches(headers(("Authorization", "Bearer clé")), "clé")


def test_single_header() -> None:
    assert single_header(headers(), "x-api-key") is None
    assert single_header(headers(("X-Api-Key", "k")), "x-api-key") == "k"
    with pytest.raises(AuthError, match="once"):
        single_header(headers(("x-api-key", "a"), ("x-api-key", "b")), "x-api-key")
    assert single_header({"x-api-key": "k"}, "x-api-key") == "k"


async def test_non_utf8_authorization_bytes_are_a_401_not_a_500(aiohttp_server) -> None:
    """What aiohttp hands a handler for raw non-UTF-8 header bytes must compare, not raise."""

    async def guarded(request: web.Request) -> web.Response:
        if not bearer_matches(request.headers, "s3cret"):
            return ApiError(401, "invalid key", code="invalid_api_key").response()
        return json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/x", guarded)
    server = await aiohttp_server(app, host="127.0.0.1")
    for auth in (b"Bearer \xff\xfe\x80", b"bearer s3cret", b"Bearer s3cret\xc3"):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: "
                     + auth + b"\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        await writer.wait_closed()
        expected = b"200" if auth == b"bearer s3cret" else b"401"
        assert status_line.split()[1] == expected, (auth, status_line)


async def test_keyed_listener_middlewares(aiohttp_client) -> None:
    from batcher.http.middleware import answer_errors, require_bearer

    async def ok(request: web.Request) -> web.Response:
        return json_response({"ok": True})

    async def boom(request: web.Request) -> web.Response:
        raise ApiError(409, "taken", code="conflict")

    with pytest.raises(ValueError):
        require_bearer("", "invalid key")
    app = web.Application(middlewares=[answer_errors, require_bearer("k3y", "invalid key")])
    app.router.add_get("/ok", ok)
    app.router.add_get("/boom", boom)
    client = await aiohttp_client(app)
    good = {"Authorization": "bearer k3y"}
    resp = await client.get("/ok", headers=good)
    assert resp.status == 200 and is_valid_request_id(resp.headers["X-Request-Id"])
    for path, headers, status, code in (("/ok", {}, 401, "invalid_api_key"),
                                        ("/nope", {}, 401, "invalid_api_key"),
                                        ("/boom", good, 409, "conflict"),
                                        ("/nope", good, 404, "not_found"),
                                        ("/ok", {"Authorization": "Bearer k3y!"}, 401,
                                         "invalid_api_key")):
        resp = await client.get(path, headers=headers)
        assert resp.status == status, path
        body = await resp.json()
        assert body["error"]["code"] == code and body["error"]["message"]
        assert resp.headers["X-Request-Id"]
    resp = await client.post("/ok", headers=good)
    assert resp.status == 405 and "GET" in resp.headers["Allow"]


async def test_held_answers_wait_a_bounded_number_at_once() -> None:
    """A refusal asking to be held waits; past the limit held at once, the next goes at once."""
    import time

    from batcher.http.held_answers import HeldAnswers

    held = HeldAnswers(limit=2)
    start = time.monotonic()
    waited = await asyncio.gather(*(held.hold(0.2) for _ in range(3)))
    assert sorted(waited) == [False, True, True]
    assert 0.15 <= time.monotonic() - start < 1.0
    assert held.held == 0
    assert await held.hold(0.0) is False


async def test_api_middleware_holds_a_refusal_that_asks() -> None:
    """`ApiError(hold_s=...)` is answered after the hold, in OpenAI's shape; others at once."""
    import time

    from aiohttp.test_utils import TestClient, TestServer

    from batcher.http.errors import ApiError
    from batcher.http.middleware import api_middleware

    async def held(request: web.Request) -> web.Response:
        raise ApiError(429, "cool down", code="oversize_cooldown", retry_after=5, hold_s=0.3)

    async def plain(request: web.Request) -> web.Response:
        raise ApiError(400, "bad", code="invalid_value")

    app = web.Application(middlewares=[api_middleware(
        body_limit=lambda r: 1 << 20, authenticate=lambda r: None, caller=lambda r: "t",
        restamp_request_id=True)])
    app.router.add_post("/held", held)
    app.router.add_post("/plain", plain)
    async with TestClient(TestServer(app)) as client:
        for path, status, least, most in (("/held", 429, 0.25, 2.0), ("/plain", 400, 0.0, 0.2)):
            start = time.monotonic()
            resp = await client.post(path, data=b"{}")
            took = time.monotonic() - start
            assert resp.status == status
            assert (await resp.json())["error"]["code"] in ("oversize_cooldown", "invalid_value")
            assert least <= took < most, (path, took)


@pytest.mark.parametrize("raw", ["0", "101", "-1", "2.5", "abc", "²", "1" * 5000, ""])
def test_a_list_limit_out_of_range_or_not_a_number_is_a_400_naming_it(raw: str) -> None:
    from batcher.http.errors import ApiError
    from batcher.http.list_query import list_limit

    with pytest.raises(ApiError) as err:
        list_limit({"limit": raw})
    assert err.value.status == 400 and err.value.param == "limit"


def test_a_list_limit_is_read_as_given_or_twenty() -> None:
    from batcher.http.list_query import MAX_LIST_LIMIT, list_limit

    assert list_limit({}) == 20
    assert list_limit({"limit": "1"}) == 1
    assert list_limit({"limit": str(MAX_LIST_LIMIT)}) == MAX_LIST_LIMIT
