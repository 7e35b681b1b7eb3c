"""Hypothesis fuzzing of every public route against one live server (the tiny model, real
tokenizer, the embedding model, tenants on).

Pass figures: 500+ examples per route, 0 responses 5xx, 0 crashes (no traceback in the
server's log, checked when the server stops), and the server still answers a normal request
afterwards. Bodies are JSON of every shape (the right fields with values at the edges, wrong types,
unicode with lone surrogates, big numbers, NaN, deep nesting), raw bytes, truncated JSON and sizes
around the body limit; headers and query strings are fuzzed alongside.

Two answers above 499 are by design, not failures: 504 `deadline_exceeded` for a request that set
its own `timeout` (the client's deadline passed), and the probe's 503 `{"ok": false}` when the
deadline the caller gave it (clamped to >= 10 ms) is shorter than a one-token step.

Every request goes through a plain blocking `http.client` connection, reused while the server keeps
it open: it sends what aiohttp's client would refuse to (non-UTF-8 header bytes, any method).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.server_process import Server, assert_error_shape, server_fixture, write_tenants

KEY = "fuzz-tenant-key-0b5e"
MAX_BODY = 65536
VOCAB = 49152  # the bundled tokenizer's; ids past it are a 400
MODEL = "tiny"
EMBEDDING_MODEL = "all-minilm-l6-v2"
# Per route; FUZZ_EXAMPLES=5000 makes a deeper run (not CI's).
EXAMPLES = max(500, int(os.environ.get("FUZZ_EXAMPLES", "500")))
FUZZ = settings(deadline=None, max_examples=EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])


def _setup(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(Path(tmp.mktemp("fuzz")) / "tenants.toml", {
        "fuzzer": {"key": KEY, "tokens_per_minute": 1e9, "max_concurrent": 64}})
    return ["--tenants", str(path)]


server = server_fixture("--embedding-model", "minilm", "--max-body-bytes", str(MAX_BODY),
                        "--embedding-max-wait-ms", "1", "--default-max-tokens", "4",
                        setup=_setup)


# A blocking client that sends bytes as given ----------------------------------------------------

@dataclass(slots=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    closed: bool  # the server ends the connection after this answer

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: list[tuple[str, str | bytes]] = ()) -> Answer:
        for attempt in range(2):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.conn.putrequest(method, path, skip_accept_encoding=True)
                for name, value in headers:
                    self.conn.putheader(name, value)
                if body is not None:
                    self.conn.putheader("Content-Length", str(len(body)))
                self.conn.endheaders(body)
                resp = self.conn.getresponse()
                data = resp.read()
            except (ConnectionError, http.client.RemoteDisconnected, TimeoutError):
                self.close()
                # Only a reused keep-alive connection may have been closed under us; a fresh
                # one dropped without an answer is a failure.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                self.close()  # whatever went wrong, the next request starts clean
                raise
            if resp.will_close:
                self.close()
            return Answer(resp.status, resp.headers, data, resp.will_close)
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Client]:
    c = Client(server.port)
    yield c
    c.close()


def check(ans: Answer, allow: frozenset[tuple[int, str]] = frozenset()) -> None:
    """No 5xx (but the by-design `allow`ed (status, code) pairs), a request ID on every answer,
    errors in OpenAI's shape. A request that is not valid HTTP (a control byte in a header, say)
    never reaches the app: aiohttp answers it 400 in plain text and closes the connection."""
    if ans.headers.get("X-Request-Id") is None:
        event("status 400 from the HTTP parser")
        assert ans.status == 400 and ans.closed, (ans.status, ans.headers, ans.body[:300])
        assert ans.headers.get("Content-Type", "").startswith("text/plain"), ans.headers
        return
    event(f"status {ans.status}")  # --hypothesis-show-statistics shows the mix
    if ans.status >= 400:
        ctype = ans.headers.get("Content-Type", "")
        assert ctype.startswith("application/json"), (ans.status, ctype, ans.body[:300])
        err = assert_error_shape(ans.json())
        event(f"status {ans.status} {err['code']}")
        if ans.status >= 500:
            assert (ans.status, err["code"]) in allow, (ans.status, ans.body[:500])


# Strategies -------------------------------------------------------------------------------------
# Each body is drawn in one of two modes: `valid` keeps every field in its legal range (edges of
# that range included), so the generation paths run; hostile mode puts anything anywhere. Without
# the split, a body with a dozen fields is almost never entirely valid.

EDGE_INTS = [0, 1, -1, 2, 3, 4, 16, 64, 4096, 4097, VOCAB - 1, VOCAB, 2**20, 2**20 + 1,
             2**31 - 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**40]
EDGE_FLOATS = [0.0, -0.0, 1e-308, 5e-324, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -1.5, 1e308,
               math.inf, -math.inf, math.nan]


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """`one_of` with integer weights."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


unicode = st.text(st.characters(exclude_categories=()), max_size=30)  # lone surrogates too
clean_text = st.one_of(st.text(max_size=30), st.sampled_from(
    ["", " ", "\x00", "\ufeff", "é" * 3, "<|endoftext|>", "<|im_start|>", "{{ x }}",
     "{% for x in y %}", "\\u0000", "tiny", "\U0001f600" * 4, "\u202e", "a\r\nb"]))
small_text = st.one_of(clean_text, unicode)
edge_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers())
edge_floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
scalars = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, small_text)
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(small_text, inner, max_size=4)),
    max_leaves=12)
deep = st.integers(1, 2000).map(lambda n: "[" * n + "]" * n)


Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]  # (legal values, edge values)


def legal(valid: st.SearchStrategy[Any]) -> Field:
    return valid, json_values


def field(spec: Field, hostile: bool) -> st.SearchStrategy[Any]:
    """A legal value; in hostile mode, as often an edge value or anything at all."""
    valid, edges = spec
    return weighted((2, valid), (1, edges), (1, json_values)) if hostile else valid


def bodies(required: dict[str, Field], optional: dict[str, Field]
           ) -> st.SearchStrategy[dict[str, Any]]:
    def build(hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries({k: field(v, hostile) for k, v in required.items()},
                                     optional={k: field(v, hostile) for k, v in optional.items()})
    return weighted((1, build(False)), (1, build(True)))


ints = st.sampled_from(EDGE_INTS)
floats = st.sampled_from(EDGE_FLOATS)
token_ids = st.integers(0, VOCAB - 1)
prompts: Field = (
    weighted((4, clean_text.filter(bool)),
             (1, st.lists(clean_text.filter(bool), min_size=1, max_size=3)),
             (1, st.lists(token_ids, min_size=1, max_size=8)),
             (1, st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=2)),
             (1, st.integers(200, 3000).map(lambda n: "word " * n))),  # context, offload paths
    st.one_of(unicode, st.lists(ints, max_size=4), st.just([]), st.just([[]]), st.just(""),
              st.lists(st.one_of(ints, small_text), min_size=1, max_size=3)))
GENERATION_OPTIONAL: dict[str, Field] = {
    "max_tokens": (st.integers(1, 4), st.one_of(ints, st.sampled_from([1.0, 1.5, True, "4"]))),
    "temperature": (st.floats(0, 2), floats),
    "top_p": (st.floats(0, 1), floats),
    "top_k": (st.integers(-1, 50), edge_ints),
    "seed": (st.integers(-(2**63), 2**63 - 1), edge_ints),
    "stop": (st.one_of(clean_text.filter(bool), st.lists(clean_text.filter(bool), max_size=4)),
             st.one_of(small_text, st.lists(small_text, max_size=6))),
    "stream": legal(st.booleans()),
    "stream_options": legal(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "n": (st.integers(1, 2), edge_ints),
    "priority": (st.one_of(st.sampled_from(["interactive", "batch"]), st.integers(-5, 5)),
                 st.one_of(st.sampled_from(["realtime", ""]), edge_ints)),
    "failover": (st.sampled_from(["error", "resume"]), st.just("retry")),
    # Small positive deadlines are legal: they end in 504 deadline_exceeded (see `allow`).
    "timeout": (st.floats(30, 86400), st.one_of(floats, st.floats(0.0005, 1))),
    "user": (clean_text, unicode),
    "ignore_eos": legal(st.booleans()),
    "min_tokens": (st.integers(0, 6), edge_ints),
    "presence_penalty": (st.floats(-2, 2), floats),
    "frequency_penalty": (st.floats(-2, 2), floats),
    "repetition_penalty": (st.floats(0.5, 2), floats),
    "min_p": (st.floats(0, 1), floats),
    "stop_token_ids": (st.lists(token_ids, max_size=3), st.one_of(json_values, st.lists(ints))),
    "response_format": (st.just({"type": "text"}), json_values),
    "tool_choice": (st.just("none"), json_values),
    "audio": (st.none(), json_values),
    "prediction": (st.none(), json_values),
    "guided_json": (st.none(), json_values),
    "guided_regex": (st.none(), st.one_of(small_text, json_values)),
    "guided_grammar": (st.none(), st.one_of(small_text, json_values)),
    "return_token_ids": legal(st.booleans()),
    "tools": (st.just([]), json_values),
    "logit_bias": (st.dictionaries(token_ids.map(str), st.floats(-100, 100), max_size=2),
                   st.one_of(json_values, st.dictionaries(clean_text, floats, max_size=2))),
    "an_unknown_field": legal(json_values),
}
FUZZ_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}}}}
completion_bodies = bodies(
    {"model": (st.just(MODEL), st.sampled_from(["TINY", "gpt-4", ""])), "prompt": prompts},
    {**GENERATION_OPTIONAL, "logprobs": (st.integers(0, 20), edge_ints),
     # 0 with echo scores the prompt (prompt logprobs with `logprobs`); without echo a 400.
     "max_tokens": (st.integers(0, 4), st.one_of(ints, st.sampled_from([1.0, 1.5, True, "4"]))),
     "echo": legal(st.booleans()), "suffix": (st.just(""), small_text),
     "best_of": legal(edge_ints)})

content_parts = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url", "input_audio", ""]),
     "text": small_text}, optional={"image_url": json_values}), max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "user", "assistant", "tool", "developer",
                              "function", "root", ""]),
     "content": weighted((6, clean_text), (1, unicode), (2, content_parts), (1, json_values))},
    optional={"name": small_text, "tool_calls": json_values, "tool_call_id": json_values})
chat_bodies = bodies(
    {"model": (st.just(MODEL), st.just("gpt-4o")),
     "messages": (st.lists(message, min_size=1, max_size=4),
                  st.lists(json_values, max_size=3))},
    {**GENERATION_OPTIONAL, "logprobs": legal(st.booleans()),
     "top_logprobs": (st.integers(0, 20), edge_ints),
     "max_completion_tokens": (st.integers(1, 4), ints),
     "tools": (st.sampled_from([[], [FUZZ_TOOL]]), json_values),
     "tool_choice": (st.sampled_from(["none", "auto", "required"]), json_values),
     "parallel_tool_calls": legal(st.booleans()),
     "modalities": (st.just(["text"]), json_values)})
embedding_bodies = bodies(
    {"model": (st.just(EMBEDDING_MODEL), st.sampled_from([MODEL, ""])),
     "input": (weighted((4, clean_text.filter(bool)),
                        (3, st.lists(clean_text.filter(bool), min_size=1, max_size=4))),
               st.one_of(unicode, st.lists(small_text, max_size=4), st.lists(token_ids),
                         st.sampled_from([64, 65, 2049]).map(lambda n: ["x"] * n)))},
    {"encoding_format": (st.sampled_from(["float", "base64"]), st.just("binary")),
     "dimensions": legal(edge_ints), "user": (clean_text, unicode)})

tokenize_bodies = weighted(
    (1, bodies({"prompt": prompts}, {"model": (st.just(MODEL), st.just("gpt-4")),
                                     "add_special_tokens": legal(st.booleans()),
                                     "return_token_strs": legal(st.booleans())})),
    (1, bodies({"messages": (st.lists(message, min_size=1, max_size=4),
                             st.lists(json_values, max_size=3))},
               {"add_generation_prompt": legal(st.booleans())})),
    (1, bodies({"tokens": (st.lists(token_ids, max_size=8), st.one_of(
        json_values, st.lists(ints)))}, {"model": (st.just(MODEL), st.just(""))})))


def encode(value: Any) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, big ints, escaped surrogates."""
    return json.dumps(value, allow_nan=True).encode()


def raw_bodies(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    pad = st.sampled_from([0, 1, MAX_BODY - 200, MAX_BODY, MAX_BODY + 1, 3 * MAX_BODY])
    return weighted(
        (14, structured.map(encode)), (1, json_values.map(encode)),
        (1, st.tuples(structured.map(encode), st.integers(1, 50)).map(lambda t: t[0][:-t[1]])),
        (1, st.tuples(structured.map(encode), pad).map(lambda t: t[0] + b" " * t[1])),
        (1, st.binary(max_size=200)), (1, deep.map(str.encode)),
        (1, st.sampled_from([b"", b"null", b"{}", b"[]", b"\xef\xbb\xbf{}", b'{"a":1}{"b":2}',
                             b'{"model":"tiny","prompt":"hi","max_tokens":1,"max_tokens":2}'])))


HEADER_NAMES = ["X-Request-Id", "Content-Type", "Content-Encoding", "Accept", "Accept-Encoding",
                "Accept-Language", "User-Agent", "Cookie", "Range", "If-None-Match", "Origin",
                "X-Forwarded-For", "X-Attempt", "X-Api-Key", "Idempotency-Key", "Expect",
                "Traceparent", "X-Replica-State", "Priority"]
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                    exclude_characters="\x7f"), max_size=60)
header_values = st.one_of(header_text, st.sampled_from(
    ["gzip", "deflate", "br", "zstd", "identity", "application/json", "text/plain",
     "multipart/form-data; boundary=x", "application/json; charset=latin-1", "100-continue",
     "req-1", "a" * 128, "a" * 129, "x" * 8000]),
    st.binary(max_size=40).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00") or b"x"))
fuzzed_headers = st.lists(st.tuples(
    st.one_of(st.sampled_from(HEADER_NAMES),
              st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20).map(
                  lambda s: "X-" + s)),
    header_values), min_size=1, max_size=4)
header_lists = weighted((3, st.just([])), (1, fuzzed_headers))
auth_headers = weighted(
    (16, st.just([("Authorization", f"Bearer {KEY}")])), (1, st.just([("X-Api-Key", KEY)])),
    (1, st.just([])), (1, header_text.map(lambda v: [("Authorization", v)])),
    (1, header_text.map(lambda v: [("Authorization", "Bearer " + v)])))
query = st.one_of(
    st.just(""), st.dictionaries(small_text, small_text, max_size=3).map(
        lambda d: "?" + urllib.parse.urlencode(d, errors="surrogatepass")),
    st.sampled_from(["?", "?&&", "?a=%zz", "?a=%ff%fe", "?a=1&a=2", "?" + "q=x&" * 500,
                     "?timeout=1e400", "?%00=%00"]))


def send_post(client: Client, path: str, auth: list[tuple[str, str]],
              extra: list[tuple[str, Any]], body: bytes, q: str) -> Answer:
    headers = [("Content-Type", "application/json"), *auth, *extra]
    return client.send("POST", path + q, body, headers)


def timeout_allow(body: bytes) -> frozenset[tuple[int, str]]:
    """504 deadline_exceeded is legal only for a body that set a numeric `timeout`."""
    return frozenset({(504, "deadline_exceeded")}) if b'"timeout"' in body else frozenset()


# Tests, one server for all ---------------------------------------------------------------------
# The @example cases are what fuzzing found once (each fixed in the server): they always run.

AUTH = [("Authorization", f"Bearer {KEY}")]
HELLO = b'{"model":"tiny","prompt":"hi","max_tokens":1}'

@pytest.mark.slow
@FUZZ
@given(body=raw_bodies(completion_bodies), auth=auth_headers, extra=header_lists, q=query)
@example(body=HELLO, auth=AUTH, extra=[("Expect", b"\xff\xfe")], q="")  # was a 500
@example(body=HELLO, auth=AUTH, extra=[("Expect", "0")], q="")  # was a plain 417
@example(body=HELLO, auth=AUTH, extra=[("X-Request-Id", b"\x01")], q="")  # traceback in the log
@example(body=b"\x00garbage", auth=[], extra=[("Content-Encoding", "deflate")],
         q="")  # was a traceback in the log
def test_fuzz_completions(client: Client, body: bytes, auth: list[tuple[str, str]],
                          extra: list[tuple[str, Any]], q: str) -> None:
    check(send_post(client, "/v1/completions", auth, extra, body, q), timeout_allow(body))


@pytest.mark.slow
@FUZZ
@given(body=raw_bodies(chat_bodies), auth=auth_headers, extra=header_lists, q=query)
def test_fuzz_chat_completions(client: Client, body: bytes, auth: list[tuple[str, str]],
                               extra: list[tuple[str, Any]], q: str) -> None:
    check(send_post(client, "/v1/chat/completions", auth, extra, body, q), timeout_allow(body))


@pytest.mark.slow
@FUZZ
@given(body=raw_bodies(embedding_bodies), auth=auth_headers, extra=header_lists, q=query)
@example(body=encode({"model": EMBEDDING_MODEL, "input": ["x"] * 65}), auth=AUTH, extra=[],
         q="")  # was a 503 for ever: more inputs than the queue held
def test_fuzz_embeddings(client: Client, body: bytes, auth: list[tuple[str, str]],
                         extra: list[tuple[str, Any]], q: str) -> None:
    check(send_post(client, "/v1/embeddings", auth, extra, body, q))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@FUZZ
@given(body=raw_bodies(tokenize_bodies), auth=auth_headers, extra=header_lists, q=query)
def test_fuzz_tokenize_routes(client: Client, path: str, body: bytes,
                              auth: list[tuple[str, str]], extra: list[tuple[str, Any]],
                              q: str) -> None:
    check(send_post(client, path, auth, extra, body, q))


@pytest.mark.parametrize("path", ["/health", "/ready", "/v1/state", "/metrics", "/v1/models"])
@FUZZ
@given(auth=auth_headers, extra=header_lists, q=query,
       body=st.one_of(st.none(), st.none(), st.binary(max_size=100)))
def test_fuzz_get_routes(client: Client, path: str, auth: list[tuple[str, str]],
                         extra: list[tuple[str, Any]], q: str, body: bytes | None) -> None:
    ans = client.send("GET", path + q, body, [*auth, *extra])
    check(ans)
    if path != "/v1/models" and ans.status != 200:
        # Open routes need no key; only a malformed request (or request ID) is refused.
        assert ans.status == 400, (ans.status, ans.body[:300])
        assert ans.headers.get("X-Request-Id") is None or b"X-Request-Id" in ans.body, ans.body


probe_timeouts = st.one_of(
    st.sampled_from(["1", "0", "-1", "0.5", "60", "61", "1e9", "1e400", "-1e400", "nan", "NaN",
                     "inf", "-inf", "", " ", "1_0", "0x10", "١", "1e-9", "true", "null"]),
    st.floats().map(repr), small_text)


@FUZZ
@given(timeout=st.one_of(st.none(), probe_timeouts), auth=auth_headers, extra=header_lists,
       body=st.one_of(st.none(), st.binary(max_size=50)))
@example(timeout="nan", auth=[], extra=[], body=None)  # was a failed 10 ms probe
def test_fuzz_probe(client: Client, timeout: str | None, auth: list[tuple[str, str]],
                    extra: list[tuple[str, Any]], body: bytes | None) -> None:
    q = "" if timeout is None else "?" + urllib.parse.urlencode(
        {"timeout": timeout}, errors="surrogatepass")
    ans = client.send("POST", "/v1/probe" + q, body, [*auth, *extra])
    if ans.status == 503:
        # By design: a probe that missed the caller's own deadline says so. Only legal for a
        # deadline shorter than a step could ever be met in.
        assert ans.json()["ok"] is False, ans.body
        assert timeout is not None and float(timeout) < 0.5, (timeout, ans.body)
        return
    check(ans)


@FUZZ
@given(rid=st.one_of(small_text, unicode, st.sampled_from(["..", ".", "%2e%2e", "%2F", "a" * 5000,
                                                           "%ff", "req-1", "x:y:0"])),
       auth=auth_headers, extra=header_lists, q=query)
def test_fuzz_cancel(client: Client, rid: str, auth: list[tuple[str, str]],
                     extra: list[tuple[str, Any]], q: str) -> None:
    path = "/v1/requests/" + urllib.parse.quote(rid, safe="%:.", errors="surrogatepass")
    ans = client.send("DELETE", path + q, None, [*auth, *extra])
    check(ans)
    assert ans.status in (401, 404, 405, 400, 414, 431), (ans.status, ans.body[:300])


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD",
                               "TRACE", "PROPFIND", "BREW"]),
       path=st.one_of(st.sampled_from(["/", "/v1", "/v1/", "/admin/drain", "/admin/status",
                                       "/v1/completions/", "//v1/models", "/v1/models/tiny",
                                       "/internal/heartbeat", "/v1/requests/", "/%00", "*",
                                       "http://127.0.0.1/v1/models", "/a/../v1/models",
                                       "/%2e%2e/%2e%2e/etc", "/v1/models?%ff"]),
                      st.text(max_size=40).map(lambda s: "/" + urllib.parse.quote(
                          s, safe="/%", errors="surrogatepass"))),
       auth=auth_headers, extra=header_lists,
       body=st.one_of(st.none(), st.binary(max_size=100)))
@example(method="GET", path="/nope", auth=[], extra=[("Expect", b"\xff")], body=None)
@example(method="GET", path="/%0A", auth=[], extra=[("Expect", b"\xff")], body=None)
def test_fuzz_any_method_and_path(client: Client, method: str, path: str,
                                  auth: list[tuple[str, str]], extra: list[tuple[str, Any]],
                                  body: bytes | None) -> None:
    ans = client.send(method, path, body, [*auth, *extra])
    if method == "HEAD":
        assert ans.status < 500, ans.status
        return
    check(ans)


def test_server_still_serves_after_fuzzing(client: Client, server: Server) -> None:
    ans = client.send("POST", "/v1/completions", encode(
        {"model": MODEL, "prompt": "still there?", "max_tokens": 3}),
        [("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json")])
    assert ans.status == 200, ans.body
    assert ans.json()["usage"]["completion_tokens"] == 3
    assert client.send("GET", "/ready").status == 200
    assert server.proc.poll() is None
