"""The official `openai` (Responses) and `anthropic` (Messages) clients against the replica's
app on the bundled model, in-process on a real port (the async clients share the test's event
loop with the server), and once more through a `batcher router` process: whole answers,
streams, tool loops (a stored response continued by `previous_response_id`; a tool_result
answered), stored responses read and deleted, errors as each client's own exception classes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from batcher.admission.admission import Admission
from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.engine.metrics import Metrics
from batcher.runtime.model_runner import ModelRunner
from batcher.server.app import create_app
from batcher.server.auth import Authenticator
from batcher.server.gateway import Gateway, GatewayConfig
from batcher.server.responses_store import StoreConfig
from batcher.admission.tenants import TenantConfig, hash_key
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.fleet.procs import ADMIN_KEY, free_port, router, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.asyncio(loop_scope="module")]

MODEL = "smollm2-135m"
KEY, OTHER_KEY = "agent-key-0123", "agent-other-4567"
TENANTS = {name: TenantConfig(name=name, key_sha256=(hash_key(key),), tokens_per_minute=1e9,
                              max_concurrent=16)
           for name, key in (("main", KEY), ("other", OTHER_KEY))}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
QUESTION = "What is the weather in Paris? Use the tool."
# Anthropic's client sends sampling fields through `extra_body` (its create() has none).
GREEDY = {"temperature": 0}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(smollm_fp32, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The replica's app over the bundled model, with stored responses in SQLite."""
    tokenizer = load_tokenizer()

    async def build() -> Gateway:
        metrics = Metrics()
        engine = AsyncEngine(ModelRunner(smollm_fp32, num_blocks=256, block_size=16),
                             tokenizer, SchedulerConfig(max_num_seqs=8,
                                                        max_num_batched_tokens=512,
                                                        max_model_len=2048), metrics=metrics)
        return Gateway(GatewayConfig(model_name=MODEL, max_model_len=2048), engine,
                       Authenticator(TENANTS), Admission(TENANTS), metrics)

    app = create_app(build, 1 << 20, probe_keys=(ADMIN_KEY,),
                     responses=StoreConfig(tmp_path_factory.mktemp("agent-apis")))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router_url(server: str) -> AsyncIterator[str]:
    """A `batcher router` process in front of the in-process replica (which answers it only
    while the test awaits, so readiness is polled without blocking the loop)."""
    rt = router(replicas=(server,))
    with running(rt):
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(rt.url + "/ready") as resp:
                        if resp.status == 200:
                            break
                assert rt.p.poll() is None, rt.tail()
                await asyncio.sleep(0.1)
            else:
                raise TimeoutError(f"the router was not ready:\n{rt.tail()}")
        yield rt.url


def oai(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    # max_retries=0: a retried error would hide what the tests check; loopback only.
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60,
                              http_client=openai.DefaultAsyncHttpxClient(trust_env=False))


def ant(url: str, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=url, api_key=key, max_retries=0, timeout=60,
        http_client=anthropic.DefaultAsyncHttpxClient(trust_env=False))


def weather_tool_openai() -> dict[str, Any]:
    return {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER}


async def responses_tool_loop(client: openai.AsyncOpenAI) -> None:
    """Turn 1 must call the tool (tool_choice required); turn 2 answers from its output,
    continuing the stored response."""
    first = await client.responses.create(
        model=MODEL, input=QUESTION, tools=[weather_tool_openai()], tool_choice="required",
        max_output_tokens=40, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[weather_tool_openai()],
        tool_choice="none", max_output_tokens=12, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 C"}])
    assert second.previous_response_id == first.id
    assert second.output_text and second.status in ("completed", "incomplete")
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text


async def test_responses_create(server: str) -> None:
    async with oai(server) as client:
        r = await client.responses.create(model=MODEL, instructions="Answer in one word.",
                                          input="What is the capital of France?",
                                          max_output_tokens=8, temperature=0,
                                          metadata={"case": "one"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and "paris" in r.output_text.lower()
    assert r.metadata == {"case": "one"} and r.instructions == "Answer in one word."
    assert r.usage is not None and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


async def test_responses_stream(server: str) -> None:
    """The helper stream to `response.completed`; the raw stream of a reply cut by
    max_output_tokens ends with `response.incomplete`, as OpenAI's does."""
    async with oai(server) as client:
        async with client.responses.stream(
                model=MODEL, instructions="Answer in one word.",
                input="What is the capital of France?", max_output_tokens=16,
                temperature=0) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        cut = [e async for e in await client.responses.create(
            model=MODEL, input="Name a colour.", max_output_tokens=3, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "paris" in text.lower() and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens < 16
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.usage.output_tokens == 3


async def test_responses_tool_loop_and_storage(server: str) -> None:
    async with oai(server) as client, oai(server, OTHER_KEY) as other:
        await responses_tool_loop(client)
        r = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(r.id)  # another tenant's id
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="Hi", previous_response_id=r.id,
                                         max_output_tokens=2)
        await client.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)
        unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                                 store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="Hi",
                                          reasoning={"effort": "high"})
    assert err.value.body["param"] == "reasoning"  # type: ignore[index]


async def test_messages_create(server: str) -> None:
    async with ant(server) as client:
        m = await client.messages.create(
            model=MODEL, max_tokens=8, extra_body=GREEDY, system="Answer in one word.",
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    [block] = m.content
    assert block.type == "text" and "paris" in block.text.lower()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 8


async def test_messages_stream(server: str) -> None:
    async with ant(server) as client, client.messages.stream(
            model=MODEL, max_tokens=6, extra_body=GREEDY,
            messages=[{"role": "user", "content": "Name a colour."}]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


async def test_messages_tool_loop_and_errors(server: str) -> None:
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}
    async with ant(server) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                             tools=[tool], tool_choice={"type": "any"},
                                             messages=messages)
        assert first.stop_reason == "tool_use"
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input, dict)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": "Sunny, 21 C"}]}]
        # tool_choice none: the answer is text (and no second grammar is compiled).
        second = await client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                              tools=[tool], tool_choice={"type": "none"},
                                              messages=messages)
        assert second.content and second.content[0].type == "text"
        counted = await client.messages.count_tokens(model=MODEL, messages=messages,
                                                     tools=[tool], tool_choice={"type": "none"})
        assert counted.input_tokens == second.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError) as err:
            await client.messages.create(model=MODEL, max_tokens=4,
                                         extra_body={"temperature": 1.5},
                                         messages=[{"role": "user", "content": "Hi"}])
        assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    async with ant(server, "not-a-key") as bad:
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model=MODEL, max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])


async def test_through_the_router(router_url: str) -> None:
    """Both APIs unchanged through `batcher router`: a stored response is found on its
    replica, and each stream ends where its last event says."""
    async with oai(router_url) as client:
        await responses_tool_loop(client)
        async with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=3,
                                           temperature=0) as stream:
            kinds = [e.type async for e in stream]
        assert kinds[-1] == "response.incomplete"
    async with ant(router_url) as client, client.messages.stream(
            model=MODEL, max_tokens=3, extra_body=GREEDY,
            messages=[{"role": "user", "content": "Hi"}]) as s:
        assert (await s.get_final_message()).usage.output_tokens == 3
