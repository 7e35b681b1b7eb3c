"""The stream ledger (pure): events passed on as they complete, what the client saw, the body of
a resume elsewhere and the explicit end of a broken stream; the per-source beat limiter."""

from __future__ import annotations

import orjson

from batcher.fleet.router import batch_ids
from batcher.fleet.router.ratelimit import SourceLimiter
from batcher.fleet.router.stream_ledger import StreamLedger


def event(text: str, ids: list[int] | None = None, finish: str | None = None,
          **extra: object) -> bytes:
    choice: dict[str, object] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return b"data: " + orjson.dumps({"choices": [choice], **extra}) + b"\n\n"


def test_complete_events_pass_through_and_partial_ones_wait() -> None:
    led = StreamLedger(chat=False, n=1)
    buf = bytearray(event("Hel") + event("lo")[:7])
    taken = led.take(buf, cancelled=False)
    assert taken.out == event("Hel") and not taken.done and taken.failure is None
    buf += event("lo")[7:] + event("", finish="length") + b"data: [DONE]\n\n"
    taken = led.take(buf, cancelled=False)
    assert taken.done and taken.out.endswith(b"data: [DONE]\n\n") and not buf
    assert led.sent == 2 and led.complete and led.texts == {0: ["Hel", "lo"]}


def test_a_replica_error_is_a_failure_unless_the_client_caused_it() -> None:
    err = b'data: {"error": {"message": "engine died", "code": "engine_error"}}\n\n'
    led = StreamLedger(chat=False, n=1)
    taken = led.take(bytearray(event("a") + err), cancelled=False)
    assert taken.out == event("a") and taken.failure == "the replica reported: engine died"
    assert led.take(bytearray(err), cancelled=True).out == err  # cancelled: its answer
    late = b'data: {"error": {"message": "late", "code": "deadline_exceeded"}}\n\n'
    assert led.take(bytearray(late), cancelled=False).failure is None


def test_resume_is_token_exact_and_strips_the_ids_it_asked_for() -> None:
    led = StreamLedger(chat=False, n=1, strip_ids=True)
    first = b"data: " + orjson.dumps({"prompt_token_ids": [5, 6, 7], "choices": [
        {"index": 0, "text": "x", "token_ids": [11], "finish_reason": None}]}) + b"\n\n"
    out = led.take(bytearray(first + event("y", [12])), cancelled=False).out
    assert b"token_ids" not in out and led.generated == 2
    body = {"prompt": "p", "max_tokens": 10, "failover": "resume", "min_tokens": 3}
    assert led.resumable(body)
    nxt = led.resume(body, 16, "rid")
    assert isinstance(nxt, dict)
    assert nxt["prompt"] == [5, 6, 7, 11, 12] and nxt["max_tokens"] == 8
    assert nxt["min_tokens"] == 1 and nxt["return_token_ids"] is True
    final = led.take(bytearray(event("", [13], finish="length")), cancelled=False).out
    assert orjson.loads(final[6:])["resumed_at"] == 2
    assert not led.resumable({"prompt": "p", "failover": "error"})


def test_a_broken_stream_ends_explicitly_with_what_was_sent() -> None:
    led = StreamLedger(chat=False, n=2)
    led.take(bytearray(event("a") + event("b")), cancelled=False)
    out = led.broken("replica r1 closed the stream early")
    err = orjson.loads(out.split(b"\n\n")[0][6:])["error"]
    assert err["code"] == "upstream_failed" and err["tokens_sent"] == 2
    assert err["partial_output"] == ["ab", ""] and out.endswith(b"data: [DONE]\n\n")
    assert led.broke


def test_beats_are_limited_per_source_in_bounded_memory() -> None:
    lim = SourceLimiter(rate=2.0, burst=2, max_sources=3)
    assert [lim.allow("a", 0.0) for _ in range(3)] == [True, True, False]
    assert lim.allow("b", 0.0)  # another source has its own bucket
    assert lim.allow("a", 0.5) and not lim.allow("a", 0.5)  # one back after 1/rate
    for i in range(10):
        lim.allow(f"flood-{i}", 1.0)
    assert len(lim._buckets) == 3


def named(kind: str, payload: dict[str, object]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def test_a_broken_messages_stream_ends_with_anthropics_error_event() -> None:
    led = StreamLedger(chat=True, n=1, path="/v1/messages")
    led.take(bytearray(named("message_start", {"type": "message_start"}) + named(
        "content_block_delta", {"type": "content_block_delta", "index": 0,
                                "delta": {"type": "text_delta", "text": "Hel"}})),
             cancelled=False)
    out = led.broken("replica r1 closed the stream early")
    assert out.startswith(b"event: error\ndata: ") and b"[DONE]" not in out
    body = orjson.loads(out.split(b"\n")[1][6:])
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "after 1 tokens" in body["error"]["message"] and led.broke


def test_a_broken_responses_stream_ends_with_response_failed() -> None:
    led = StreamLedger(chat=True, n=1, path="/v1/responses")
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [],
               "model": "tiny"}
    item = {"type": "message", "id": "msg_1", "status": "completed", "content": []}
    led.take(bytearray(
        named("response.created", {"type": "response.created", "sequence_number": 0,
                                   "response": created})
        + named("response.output_item.done", {"type": "response.output_item.done",
                                              "sequence_number": 1, "item": item})
        + named("response.output_text.delta", {"type": "response.output_text.delta",
                                               "sequence_number": 2, "delta": "Hi"})),
             cancelled=False)
    out = led.broken("replica r1 closed the stream early")
    assert out.startswith(b"event: response.failed\ndata: ") and b"[DONE]" not in out
    ev = orjson.loads(out.split(b"\n")[1][6:])
    assert ev["type"] == "response.failed" and ev["sequence_number"] == 3
    resp = ev["response"]
    assert resp["id"] == "resp_1" and resp["status"] == "failed" and resp["output"] == [item]
    assert resp["error"]["code"] == "server_error" and "after 1 tokens" in \
        resp["error"]["message"]


def test_a_responses_streams_ids_name_the_replica_serving_it() -> None:
    led = StreamLedger(chat=True, n=1, path="/v1/responses", owner="r0")
    resp = {"id": "resp_1", "previous_response_id": "resp_0", "status": "in_progress"}
    delta = named("response.output_text.delta", {"type": "response.output_text.delta",
                                                 "sequence_number": 1, "delta": "Hi"})
    out = led.take(bytearray(named("response.created", {
        "type": "response.created", "sequence_number": 0, "response": resp}) + delta),
        cancelled=False).out
    first, rest = out.split(b"\n\n", 1)
    got = orjson.loads(first.split(b"\n")[1][6:])["response"]
    assert got["id"] == batch_ids.encode("resp_1", "r0")
    assert got["previous_response_id"] == batch_ids.encode("resp_0", "r0")
    assert rest == delta  # events without a response object pass as they came
