"""Malformed /v1/responses and /v1/messages bodies, in-process on the tiny model: lists where
strings go, objects where lists go, nulls, huge numbers, deep nesting. Every one is a 400 in the
route's own error shape (OpenAI's on /v1/responses, Anthropic's on /v1/messages), never a 5xx."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_agent_api_http import ALICE, key, make_app

DEEP: Any = "x"
for _ in range(60):
    DEEP = [DEEP]
HUGE = 10**40

RESPONSES: list[dict[str, Any]] = [
    {"input": [{"role": ["user"], "content": "hi"}]},
    {"input": [{"role": {"a": 1}, "content": "hi"}]},
    {"input": [{"role": None, "content": "hi"}]},
    {"input": [{"role": "user", "content": {"text": "hi"}}]},
    {"input": [{"role": "user", "content": [["hi"]]}]},
    {"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": ["hi"]}]}]},
    {"input": [{"type": ["message"], "role": "user", "content": "hi"}]},
    {"input": [{"type": {"k": 1}, "role": "user", "content": "hi"}]},
    {"input": [{"type": "function_call", "name": ["f"], "arguments": "{}", "call_id": "c"}]},
    {"input": [{"type": "function_call_output", "call_id": ["c"], "output": "x"}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}]},
    {"input": {"role": "user", "content": "hi"}},
    {"input": None},
    {"input": 7},
    {"input": []},
    {"input": DEEP},
    {"input": "hi", "instructions": ["be brief"]},
    {"input": "hi", "previous_response_id": ["resp_1"]},
    {"input": "hi", "store": "yes"},
    {"input": "hi", "stream": [True]},
    {"input": "hi", "tools": {"type": "function"}},
    {"input": "hi", "tools": [["function"]]},
    {"input": "hi", "tools": [{"type": ["function"]}]},
    {"input": "hi", "tools": [{"type": "function", "name": ["f"]}]},
    {"input": "hi", "tool_choice": ["auto"]},
    {"input": "hi", "tool_choice": {"type": ["function"]}},
    {"input": "hi", "max_output_tokens": HUGE},
    {"input": "hi", "max_output_tokens": "5"},
    {"input": "hi", "max_output_tokens": [5]},
    {"input": "hi", "temperature": HUGE},
    {"input": "hi", "temperature": [1]},
    {"input": "hi", "top_p": {"p": 1}},
    {"input": "hi", "text": ["json"]},
    {"input": "hi", "text": {"format": ["json_object"]}},
    {"input": "hi", "text": {"format": {"type": ["json_schema"]}}},
    {"input": "hi", "text": {"format": {"type": "json_schema", "schema": DEEP}}},
    {"input": "hi", "metadata": ["a"]},
    {"input": "hi", "reasoning": ["low"]},
    {"input": "hi", "user": ["u"]},
    {"input": "hi", "parallel_tool_calls": "no"},
    {"input": "hi", "model": ["tiny"]},
    {"input": "hi", "include": "x"},
    {"input": "hi", "truncation": ["auto"]},
]

MESSAGES: list[dict[str, Any]] = [
    {"messages": [{"role": ["user"], "content": "hi"}]},
    {"messages": [{"role": None, "content": "hi"}]},
    {"messages": [{"role": "user", "content": {"text": "hi"}}]},
    {"messages": [{"role": "user", "content": [["hi"]]}]},
    {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ["hi"]}]}]},
    {"messages": [{"role": "user", "content": [{"type": {"t": 1}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": ["t"]}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": [["x"]]}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": 7}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                     "name": "f", "input": DEEP}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": ["t"],
                                                     "name": "f"}]}]},
    {"messages": {"role": "user", "content": "hi"}},
    {"messages": None},
    {"messages": DEEP},
    {"system": ["be brief"]},
    {"system": {"text": "be brief"}},
    {"system": [{"type": "text", "text": ["be brief"]}]},
    {"max_tokens": HUGE},
    {"max_tokens": "5"},
    {"max_tokens": [5]},
    {"max_tokens": None},
    {"temperature": HUGE},
    {"temperature": [0.5]},
    {"top_p": ["x"]},
    {"top_k": {"k": 1}},
    {"top_k": HUGE},
    {"stop_sequences": "stop"},
    {"stop_sequences": [["stop"]]},
    {"stop_sequences": [None]},
    {"tools": {"name": "f"}},
    {"tools": [{"name": ["f"], "input_schema": {}}]},
    {"tools": [{"name": "f", "input_schema": ["x"]}]},
    {"tools": [{"name": "f", "input_schema": DEEP}]},
    {"tool_choice": "auto"},
    {"tool_choice": {"type": ["auto"]}},
    {"tool_choice": {"type": "tool", "name": ["f"]}},
    {"metadata": ["u"]},
    {"stream": "yes"},
    {"thinking": ["on"]},
    {"output_config": ["json"]},
    {"output_config": {"format": ["json_schema"]}},
    {"model": ["tiny"]},
]


@pytest.fixture
async def client(aiohttp_client, tiny_fp32, tokenizer):
    return await aiohttp_client(make_app(tiny_fp32, tokenizer))


@pytest.fixture(scope="module")
def tokenizer():
    from batcher.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer()


async def test_malformed_responses_bodies_are_400s_in_openais_shape(client) -> None:
    bad = []
    for body in RESPONSES:
        resp = await client.post("/v1/responses", json={"model": "tiny", **body},
                                 headers=key())
        err = await resp.json()
        if resp.status != 400 or not isinstance(err.get("error"), dict) or not isinstance(
                err["error"].get("message"), str) or "param" not in err["error"]:
            bad.append((body, resp.status, err))
    assert not bad, bad


async def test_malformed_messages_bodies_are_400s_in_anthropics_shape(client) -> None:
    bad = []
    for extra in MESSAGES:
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}], **extra}
        resp = await client.post("/v1/messages", json=body, headers={"x-api-key": ALICE})
        err = await resp.json()
        if resp.status != 400 or err.get("type") != "error" or err.get("error", {}).get(
                "type") != "invalid_request_error":
            bad.append((extra, resp.status, err))
    assert not bad, bad
