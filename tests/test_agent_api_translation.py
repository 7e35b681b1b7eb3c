"""The Responses and Messages translations without a model: requests into chat bodies, chat
answers into response objects and messages, chat chunks into each API's event sequence, the
Anthropic error shape, the router's stream end on named events, and the stored responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from batcher.fleet.router.stream_ledger import StreamLedger
from batcher.http.anthropic_errors import reshape_error
from batcher.http.errors import ApiError
from batcher.server.bridge import read_chunk, renamed
from batcher.server.messages_protocol import MessagesEvents, chat_body
from batcher.server.messages_protocol import from_chat as message_from_chat
from batcher.server.responses_events import ResponsesEvents
from batcher.server.responses_objects import from_chat as response_from_chat
from batcher.server.responses_objects import output_messages
from batcher.server.responses_request import input_messages, parse_request
from batcher.server.responses_store import MemoryStore, Retention, SqliteStore

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def refused(fn: Any, *args: Any, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args, **kw)
    assert err.value.status == 400
    return err.value


# chat chunks as GenerationHandler streams them ---------------------------------------------------
def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish,
              **extra}
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [choice]}


ROLE = chunk({"role": "assistant", "content": ""})
USAGE = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}


def call_delta(name: str | None = None, args: str = "", cid: str = "call_abc") -> dict:
    if name is None:
        return {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}
    return {"tool_calls": [{"index": 0, "id": cid, "type": "function",
                            "function": {"name": name, "arguments": args}}]}


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every named SSE event."""
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        head, data = block.split(b"\n", 1)
        assert head.startswith(b"event: ") and data.startswith(b"data: ")
        out.append((head[7:].decode(), orjson.loads(data[6:])))
    return out


# Responses: requests ------------------------------------------------------------------------------
def test_input_items_become_chat_messages() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                  "text": "in Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"}]


@pytest.mark.parametrize("item", [
    {"type": "item_reference", "id": "msg_1"},
    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
    {"role": "tool", "content": "x"},
    {"type": "function_call", "name": "f"},
])
def test_input_items_that_cannot_be_served_name_input(item: dict[str, Any]) -> None:
    assert refused(input_messages, [item]).param == "input"


def test_responses_request_becomes_a_chat_body() -> None:
    req = parse_request({
        "model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 9,
        "temperature": 0.5, "top_p": 0.9, "store": False, "stream": True,
        "metadata": {"k": "v"}, "parallel_tool_calls": False,
        "tools": [{"type": "function", "name": "f", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": WEATHER}}})
    body = req.chat_body([{"role": "user", "content": "earlier"}])
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "earlier"},
                                {"role": "user", "content": "Hi"}]
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5 and body["top_p"] == 0.9
    assert body["tools"] == [{"type": "function",
                              "function": {"name": "f", "parameters": WEATHER}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": WEATHER}}
    assert body["stream_options"] == {"include_usage": True}
    assert body["parallel_tool_calls"] is False
    assert not req.store and req.stream and req.echo["metadata"] == {"k": "v"}


@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"input": []}, "input"),
])
def test_responses_fields_it_cannot_honour_are_named(body: dict[str, Any], param: str) -> None:
    assert refused(parse_request, {"input": "Hi", **body}).param == param


def test_reasoning_without_effort_is_accepted() -> None:
    parse_request({"input": "Hi", "reasoning": {"effort": None, "summary": None}})
    parse_request({"input": "Hi", "reasoning": None, "truncation": "disabled", "include": []})


def test_reasoning_is_served_with_a_reasoning_parser() -> None:
    req = parse_request({"input": "Hi", "reasoning": {"effort": "high"}}, reasoning=True)
    assert req.echo["reasoning"] == {"effort": "high", "summary": None}
    assert refused(parse_request, {"input": "Hi", "reasoning": "high"},
                   reasoning=True).param == "reasoning"
    # Reasoning sent back (an agent replaying its output) is dropped from the prompt.
    assert input_messages([{"type": "reasoning", "id": "rs_1", "summary": []},
                           {"role": "user", "content": "Hi"}]) == [
        {"role": "user", "content": "Hi"}]


def test_chat_errors_name_the_clients_fields() -> None:
    err = renamed(ApiError(400, "'max_tokens' must be between 1 and 9", param="max_tokens"),
                  {"max_tokens": "max_output_tokens"})
    assert err.param == "max_output_tokens" and err.message.startswith("'max_output_tokens'")


# Responses: answers and events ------------------------------------------------------------------
def chat_answer(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": USAGE["usage"]}


def test_chat_answer_becomes_a_response() -> None:
    echo = parse_request({"input": "Hi", "metadata": {"a": "b"}}).echo
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "f", "arguments": '{"city":"Paris"}'}}]
    r = response_from_chat(chat_answer({"role": "assistant", "content": "Sure.",
                                        "tool_calls": calls}, "tool_calls"), "resp_1", echo)
    assert r["id"] == "resp_1" and r["object"] == "response" and r["status"] == "completed"
    msg, call = r["output"]
    assert msg["type"] == "message" and msg["content"][0]["text"] == "Sure."
    assert call["type"] == "function_call" and call["call_id"] == "call_1"
    assert call["arguments"] == '{"city":"Paris"}' and call["id"].startswith("fc_")
    assert r["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2},
                          "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 10}
    assert r["metadata"] == {"a": "b"}
    # The next turn continues from the output as chat messages.
    assert output_messages(r["output"]) == [
        {"role": "assistant", "content": "Sure.", "tool_calls": calls}]
    cut = response_from_chat(chat_answer({"role": "assistant", "content": "Lo"}, "length"),
                             "resp_2", echo)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_responses_text_stream_events() -> None:
    done: list[dict[str, Any]] = []

    async def store(response: dict[str, Any]) -> None:
        done.append(response)

    ev = ResponsesEvents("resp_1", "m", parse_request({"input": "Hi"}).echo, store)
    raw = b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk(finish="stop"), USAGE))
    assert b"response.completed" not in raw and not done  # held until it is stored
    raw += await ev.end()
    assert await ev.end() == b""
    out = events(raw)
    assert [name for name, _ in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert all(name == data["type"] for name, data in out)
    assert [data["sequence_number"] for _, data in out] == list(range(len(out)))
    item_ids = {data["item"]["id"] for name, data in out
                if name.startswith("response.output_item")}
    assert len(item_ids) == 1
    assert out[6][1]["text"] == "Hello"
    final = out[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 3 and done == [final]


async def test_a_failed_store_is_logged_and_the_stream_still_ends(caplog) -> None:
    async def broken_store(response: dict[str, Any]) -> None:
        raise OSError("disk full")

    ev = ResponsesEvents("resp_1", "m", parse_request({"input": "Hi"}).echo, broken_store)
    raw = b"".join(ev.chunk(c) for c in (ROLE, chunk({"content": "Hi"}), chunk(finish="stop"),
                                         USAGE))
    raw += await ev.end()
    assert events(raw)[-1][0] == "response.completed"
    assert "storing it failed" in caplog.text and "disk full" in caplog.text


def test_responses_tool_call_stream_events() -> None:
    ev = ResponsesEvents("resp_1", "m", parse_request({"input": "Hi"}).echo)
    raw = b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"content": "Ok."}), chunk(call_delta("f")),
        chunk(call_delta(args='{"city":')), chunk(call_delta(args='"Paris"}')),
        chunk(finish="tool_calls"), USAGE))
    out = events(raw)
    names = [name for name, _ in out]
    assert names[names.index("response.output_text.done"):] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added = next(d for n, d in out if n == "response.output_item.added"
                 and d["item"]["type"] == "function_call")
    assert added["output_index"] == 1 and added["item"]["call_id"] == "call_abc"
    args_done = next(d for n, d in out if n == "response.function_call_arguments.done")
    assert args_done["arguments"] == '{"city":"Paris"}' and args_done["output_index"] == 1
    final = out[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["id"] == added["item"]["id"]


def test_responses_reasoning_item_before_the_reply() -> None:
    answer = chat_answer({"role": "assistant", "content": "4.", "reasoning_content": "2+2"})
    r = response_from_chat(answer, "resp_1", parse_request({"input": "Hi"}).echo)
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "2+2"}]
    assert output_messages(r["output"]) == [{"role": "assistant", "content": "4."}]
    ev = ResponsesEvents("resp_1", "m", parse_request({"input": "Hi"}).echo)
    out = events(b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"reasoning_content": "2+"}), chunk({"reasoning_content": "2"}),
        chunk({"content": "4."}), chunk(finish="stop"), USAGE)))
    assert [name for name, _ in out][2:9] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added"]
    assert out[5][1]["text"] == "2+2" and out[6][1]["item"]["type"] == "reasoning"
    assert out[7][1]["output_index"] == 1 and out[7][1]["item"]["type"] == "message"
    final = out[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]


def test_responses_stream_that_fails_ends_failed() -> None:
    ev = ResponsesEvents("resp_1", "m", parse_request({"input": "Hi"}).echo)
    raw = ev.chunk(ROLE) + ev.chunk(chunk({"content": "Hi"})) + ev.chunk(
        {"error": {"message": "the engine failed after 1 tokens", "code": "engine_error"}})
    out = events(raw)
    assert out[-1][0] == "response.failed"
    assert out[-1][1]["response"]["error"]["message"].startswith("the engine failed")
    assert out[-2][0] == "response.output_item.done"  # what it produced is closed first


# Messages -----------------------------------------------------------------------------------------
def test_messages_request_becomes_a_chat_body() -> None:
    body = chat_body({
        "model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
        "temperature": 0.2, "top_k": 5, "stop_sequences": ["END"], "stream": True,
        "metadata": {"user_id": "u"},
        "tools": [{"name": "f", "description": "d", "input_schema": WEATHER,
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "f", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": WEATHER, "description": "d"}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["top_k"] == 5 and body["max_tokens"] == 20
    assert body["stream_options"] == {"include_usage": True}
    tool = chat_body({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                      "tool_choice": {"type": "tool", "name": "f"}})
    assert tool["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
])
def test_messages_fields_it_cannot_honour_are_named(body: dict[str, Any], param: str) -> None:
    full = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **body}
    assert refused(chat_body, full).param == param


def test_thinking_with_a_reasoning_parser() -> None:
    body = {"max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "hm", "signature": "s"},
                             {"type": "text", "text": "Hello."}]},
                         {"role": "user", "content": "Again"}]}
    assert refused(chat_body, body).param == "thinking"
    chat = chat_body(body, reasoning=True)
    assert chat["messages"][1] == {"role": "assistant", "content": "Hello."}
    m = message_from_chat(chat_answer({"role": "assistant", "content": "4.",
                                       "reasoning_content": "2+2"}), "msg_1")
    assert m["content"] == [{"type": "thinking", "thinking": "2+2", "signature": ""},
                            {"type": "text", "text": "4."}]
    ev = MessagesEvents("msg_1", "m", prompt_tokens=7)
    out = events(b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"reasoning_content": "2+2"}), chunk({"content": "4."}),
        chunk(finish="stop"), USAGE)))
    assert [name for name, _ in out][2:8] == [
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop"]
    assert out[2][1]["content_block"]["type"] == "thinking"
    assert out[3][1]["delta"] == {"type": "thinking_delta", "thinking": "2+2"}
    assert out[5][1]["index"] == 1 and out[5][1]["content_block"]["type"] == "text"


def test_chat_answer_becomes_a_message() -> None:
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "f", "arguments": '{"city":"Paris"}'}}]
    m = message_from_chat(chat_answer({"role": "assistant", "content": "Sure.",
                                       "tool_calls": calls}, "tool_calls"), "msg_1")
    assert m["content"] == [{"type": "text", "text": "Sure."},
                            {"type": "tool_use", "id": "toolu_1", "name": "f",
                             "input": {"city": "Paris"}}]
    assert m["stop_reason"] == "tool_use" and m["stop_sequence"] is None
    assert m["usage"]["input_tokens"] == 7 and m["usage"]["output_tokens"] == 3
    stopped = chat_answer({"role": "assistant", "content": "x"})
    stopped["choices"][0]["stop_reason"] = "END"
    assert message_from_chat(stopped, "msg_2")["stop_reason"] == "stop_sequence"
    assert message_from_chat(stopped, "msg_2")["stop_sequence"] == "END"
    assert message_from_chat(chat_answer({"role": "assistant", "content": "x"}, "length"),
                             "msg_3")["stop_reason"] == "max_tokens"


def test_messages_stream_events() -> None:
    ev = MessagesEvents("msg_1", "m", prompt_tokens=7)
    raw = b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"content": "Ok."}), chunk(call_delta("f")),
        chunk(call_delta(args='{"city":"Paris"}')), chunk(finish="tool_calls"), USAGE))
    out = events(raw)
    assert [name for name, _ in out] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert out[0][1]["message"]["usage"]["input_tokens"] == 7
    assert out[2][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert out[3][1]["delta"] == {"type": "text_delta", "text": "Ok."}
    assert out[5][1]["index"] == 1 and out[5][1]["content_block"]["id"] == "toolu_abc"
    assert out[6][1]["delta"] == {"type": "input_json_delta",
                                  "partial_json": '{"city":"Paris"}'}
    assert out[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[8][1]["usage"] == {"output_tokens": 3}


def test_messages_stream_arguments_go_to_their_own_calls_block() -> None:
    ev = MessagesEvents("msg_1", "m", prompt_tokens=7)
    both = {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f"}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g"}}]}
    args = [{"tool_calls": [{"index": i, "function": {"arguments": a}}]}
            for i, a in ((0, '{"x":1}'), (1, '{"y":2}'))]
    out = events(b"".join(ev.chunk(c) for c in (
        ROLE, chunk({"content": "Ok."}), chunk(both), chunk(args[0]), chunk(args[1]),
        chunk(finish="tool_calls"), USAGE)))
    starts = {d["content_block"].get("id"): d["index"] for n, d in out
              if n == "content_block_start"}
    deltas = [(d["index"], d["delta"]["partial_json"]) for n, d in out
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert deltas == [(starts["toolu_a"], '{"x":1}'), (starts["toolu_b"], '{"y":2}')]


def test_messages_stream_error_event() -> None:
    ev = MessagesEvents("msg_1", "m", prompt_tokens=7)
    raw = ev.chunk(ROLE) + ev.chunk(chunk({"content": "Hi"})) + ev.chunk(
        {"error": {"message": "deadline", "code": "deadline_exceeded"}})
    out = events(raw)
    assert [name for name, _ in out][-2:] == ["content_block_stop", "error"]
    assert out[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "deadline"}}


def test_read_chunk_ignores_empty_deltas() -> None:
    assert read_chunk(chunk({})) == []
    assert [e.kind for e in read_chunk(ROLE)] == ["start"]


def test_anthropic_error_shape_on_messages_paths_only() -> None:
    err = ApiError(429, "slow down", code="tenant_budget", retry_after=3).response("rid-1")
    req = make_mocked_request("POST", "/v1/messages")
    out = reshape_error(req, err)
    assert orjson.loads(out.body) == {"type": "error", "error": {
        "type": "rate_limit_error", "message": "slow down"}}
    assert out.headers["Retry-After"] == "3" and out.headers["X-Request-Id"] == "rid-1"
    chat = ApiError(400, "bad").response()
    same = reshape_error(make_mocked_request("POST", "/v1/chat/completions"), chat)
    assert orjson.loads(same.body)["error"]["type"] == "invalid_request_error"
    ok = web.Response(body=b"{}")
    assert reshape_error(req, ok) is ok


def test_router_ledger_ends_on_named_final_events() -> None:
    for final in (b"message_stop", b"response.completed", b"response.incomplete"):
        ledger = StreamLedger(chat=True, n=1)
        buf = bytearray(b"event: message_start\ndata: {}\n\nevent: " + final
                        + b"\ndata: {}\n\n")
        taken = ledger.take(buf, cancelled=False)
        assert taken.done and taken.failure is None and taken.out.count(b"event:") == 2
    ledger = StreamLedger(chat=True, n=1)
    taken = ledger.take(bytearray(b"event: response.created\ndata: {}\n\n"), cancelled=False)
    assert not taken.done


# stored responses --------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_store_is_per_tenant_and_bounded(kind: str, tmp_path: Path) -> None:
    clock = Clock()
    retention = Retention(max_count=3, max_age_s=100.0)
    store = (MemoryStore(retention, clock) if kind == "memory"
             else SqliteStore(tmp_path / "r.sqlite3", retention, clock))
    msgs = [{"role": "user", "content": "Hi"}]
    store.put("a", "resp_1", {"id": "resp_1"}, msgs)
    got = store.get("a", "resp_1")
    assert got is not None and got.response == {"id": "resp_1"} and got.messages == msgs
    assert store.get("b", "resp_1") is None  # another tenant's id
    assert not store.delete("b", "resp_1")
    for i in range(2, 5):
        clock.now += 1
        store.put("a", f"resp_{i}", {"id": f"resp_{i}"}, msgs)
    assert store.get("a", "resp_1") is None  # the oldest went past max_count
    assert store.get("a", "resp_4") is not None
    assert store.delete("a", "resp_4") and store.get("a", "resp_4") is None
    clock.now += 101
    assert store.get("a", "resp_3") is None  # too old
    store.close()


def open_kind(kind: str, retention: Retention, tmp_path: Path, clock: Clock | None = None
              ) -> MemoryStore | SqliteStore:
    clock = clock or Clock()
    return (MemoryStore(retention, clock) if kind == "memory"
            else SqliteStore(tmp_path / "r.sqlite3", retention, clock))


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_one_tenants_flood_evicts_only_its_own(kind: str, tmp_path: Path) -> None:
    store = open_kind(kind, Retention(max_count=10, max_per_tenant=3), tmp_path)
    store.put("b", "resp_b", {"id": "resp_b"}, [])
    for i in range(8):
        store.put("a", f"resp_{i}", {"id": f"resp_{i}"}, [])
    assert store.get("b", "resp_b") is not None
    assert [i for i in range(8) if store.get("a", f"resp_{i}")] == [5, 6, 7]
    store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_stored_bytes_are_capped_oldest_first(kind: str, tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "x" * 1000}]
    row = len(orjson.dumps({"id": "resp_0"})) + len(orjson.dumps(msgs))
    store = open_kind(kind, Retention(max_bytes=3 * row + 10), tmp_path)
    for i, tenant in enumerate("abcde"):
        store.put(tenant, f"resp_{i}", {"id": f"resp_{i}"}, msgs)
    kept = [i for i, t in enumerate("abcde") if store.get(t, f"resp_{i}")]
    assert kept == [2, 3, 4] and store.bytes == 3 * row
    assert store.delete("e", "resp_4") and store.bytes == 2 * row
    store.put("d", "resp_3", {"id": "resp_3"}, msgs)  # a replaced row is counted once
    assert store.bytes == 2 * row
    store.close()
    if kind == "sqlite":
        again = SqliteStore(tmp_path / "r.sqlite3", Retention(max_bytes=3 * row + 10))
        assert again.bytes == 2 * row
        again.close()


def test_sqlite_store_outlives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = SqliteStore(path, Retention())
    store.put("a", "resp_1", {"id": "resp_1"}, [])
    store.close()
    again = SqliteStore(path, Retention())
    assert again.get("a", "resp_1") is not None
    again.close()


def test_retention_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="max-stored"):
        Retention(max_count=0).validate()
    with pytest.raises(ValueError, match="max-age"):
        Retention(max_age_s=0).validate()
    with pytest.raises(ValueError, match="per-tenant"):
        Retention(max_per_tenant=0).validate()
    with pytest.raises(ValueError, match="max-bytes"):
        Retention(max_bytes=0).validate()
