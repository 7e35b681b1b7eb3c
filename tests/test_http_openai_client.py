"""The official `openai` client against a real `batcher serve` process: the API shapes work
unchanged, and errors arrive as the client's own exception classes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.server_process import Server, server_fixture, write_tenants

MODEL = "tiny"
KEY, SMALL_KEY = "main-key-0123", "small-key-4567"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about batching."}]
# The tiny model has random weights: ask for exact lengths, not for an end of text.
EXACT = {"ignore_eos": True}


def tenants_flags(tmp: pytest.TempPathFactory) -> list[str]:
    path = write_tenants(tmp.mktemp("tenants") / "tenants.toml", {
        "main": {"key": KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 32},
        # One small request fits the bucket; the next must wait for the refill.
        "small": {"key": SMALL_KEY, "tokens_per_minute": 600, "burst": 40,
                  "max_concurrent": 4},
    })
    return ["--tenants", str(path)]


server = server_fixture(setup=tenants_flags)


def make_client(server: Server, key: str = KEY) -> OpenAI:
    # max_retries=0: a retried 429 or 503 would hide exactly what these tests check.
    # trust_env=False: loopback only, never through a proxy from the environment.
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[OpenAI]:
    with make_client(server) as c:
        yield c


def test_models_list(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_whole_answer(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                         extra_body=EXACT)
    assert out.object == "chat.completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.message.content
    assert out.usage is not None
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_chat_greedy_is_repeatable(client: OpenAI) -> None:
    texts = {client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                            temperature=0, extra_body=EXACT
                                            ).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_chat_stream_with_usage(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=7, stream=True,
        stream_options={"include_usage": True}, extra_body=EXACT))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert [d.finish_reason for d in deltas].count("length") == 1
    assert deltas[-1].finish_reason == "length"
    text = "".join(d.delta.content or "" for d in deltas)
    assert text
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_has_no_usage_chunk(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                 stream=True, extra_body=EXACT))
    assert all(c.choices and c.usage is None for c in chunks)


def test_completion_whole_and_stream(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The batcher", max_tokens=5,
                                    temperature=0, extra_body=EXACT)
    assert out.object == "text_completion"
    [choice] = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage is not None and out.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt="The batcher", max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=EXACT))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text, "greedy: the stream spells the whole answer"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_completion_token_id_prompt(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[1, 100, 200], max_tokens=3,
                                    extra_body=EXACT)
    assert out.usage is not None and out.usage.prompt_tokens == 3


def test_n2_whole_and_streamed(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,
                                         seed=7, extra_body=EXACT)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 8
    cmpl = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2,
                                     extra_body=EXACT)
    assert sorted(c.index for c in cmpl.choices) == [0, 1]
    finished: dict[int, str] = {}
    text: dict[int, str] = {0: "", 1: ""}
    usage: Any = None
    for chunk in client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body=EXACT):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert text[0] and text[1]
    # n copies of one prompt: the prompt counts once, the completions twice.
    assert usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens == cmpl.usage.prompt_tokens  # type: ignore[union-attr]


def test_completion_logprobs(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2,
                                    extra_body=EXACT)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs is not None and all(x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs is not None and len(lp.top_logprobs) == 4
    # Two alternatives each (fewer only when two token ids decode to the same text).
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_chat_logprobs_whole_and_streamed(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                         logprobs=True, top_logprobs=2, extra_body=EXACT)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    for item in lp.content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body=EXACT):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert len(streamed) == 4 and all(len(t.top_logprobs) == 2 for t in streamed)


# -- errors as the client's exception classes ---------------------------------------------------

@pytest.mark.parametrize("kw", [
    pytest.param({"model": "gpt-4o"}, id="unknown-model"),
    pytest.param({"temperature": 5}, id="temperature"),
    pytest.param({"max_tokens": -1}, id="negative-max-tokens"),
    pytest.param({"n": 17}, id="n"),
    pytest.param({"logprobs": True, "top_logprobs": 21}, id="top-logprobs"),
    pytest.param({"messages": []}, id="empty-messages"),
    pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, id="role"),
])
def test_bad_values_are_bad_request(client: OpenAI, kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | kw
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.response.headers.get("x-request-id")


def test_context_overflow_is_bad_request(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello " * 100, max_tokens=4090)
    assert info.value.code == "context_length_exceeded"
    assert "4096" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", logprobs=21, max_tokens=2)


def test_wrong_key_is_authentication_error(server: Server) -> None:
    with make_client(server, "not-a-key") as bad, pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)


def test_small_budget_is_rate_limit_error(server: Server) -> None:
    with make_client(server, SMALL_KEY) as small:
        small.completions.create(model=MODEL, prompt="Hi", max_tokens=30, extra_body=EXACT)
        with pytest.raises(openai.RateLimitError) as info:
            small.completions.create(model=MODEL, prompt="Hi", max_tokens=30, extra_body=EXACT)
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert info.value.code == "tenant_tokens"


def test_unknown_request_id_cancel_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.delete("/requests/no-such-request", cast_to=object)


def test_request_id_in_flight_is_conflict(client: OpenAI) -> None:
    headers = {"X-Request-Id": "openai-dup-1"}
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3000, stream=True,
                                       extra_body=EXACT, extra_headers=headers)
    try:
        next(iter(stream))
        with pytest.raises(openai.ConflictError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                      extra_headers=headers)
    finally:
        stream.close()
