"""A stream the router ends as broken, read by the official clients: the `anthropic` client
raises (it skips unnamed events, so a chat-shaped error would be a silent truncation), and the
`openai` client's Responses stream ends with a `response.failed` event."""

from __future__ import annotations

import anthropic
import openai
from aiohttp import web

from batcher.fleet.router.stream_ledger import StreamLedger
from batcher.http.sse import SSE_HEADERS, sse_named


async def serve_broken(aiohttp_server, path: str, head: bytes) -> str:
    async def handle(request: web.Request) -> web.StreamResponse:
        led = StreamLedger(chat=True, n=1, path=path)
        buf = bytearray(head)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(led.take(buf, cancelled=False).out)
        await resp.write(led.broken("replica r1 closed the stream early"))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(path, handle)
    server = await aiohttp_server(app)
    return str(server.make_url(""))


async def test_anthropic_client_raises_on_a_broken_messages_stream(aiohttp_server) -> None:
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 0}}}
    head = (sse_named("message_start", start)
            + sse_named("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
            + sse_named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": "Hi"}}))
    url = (await serve_broken(aiohttp_server, "/v1/messages", head)).rstrip("/")
    client = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, timeout=30,
                                      http_client=anthropic.DefaultAsyncHttpxClient(
                                          trust_env=False))
    stream = await client.messages.create(model="tiny", max_tokens=8, stream=True,
                                          messages=[{"role": "user", "content": "Hi"}])
    seen = []
    try:
        async for ev in stream:
            seen.append(ev.type)
        raise AssertionError(f"no error raised after {seen}")
    except anthropic.APIStatusError as exc:
        assert "the stream broke" in str(exc)
    assert seen[-1] == "content_block_delta"


async def test_openai_client_reads_response_failed(aiohttp_server) -> None:
    created = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
               "model": "tiny", "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
               "tools": [], "error": None, "incomplete_details": None, "instructions": None,
               "metadata": {}, "temperature": 1.0, "top_p": 1.0}
    head = sse_named("response.created", {"type": "response.created", "sequence_number": 0,
                                          "response": created})
    url = (await serve_broken(aiohttp_server, "/v1/responses", head)).rstrip("/")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30,
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    stream = await client.responses.create(model="tiny", input="Hi", stream=True)
    events = [ev async for ev in stream]
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert events[-1].sequence_number == 1 and events[-1].response.status == "failed"
    assert "the stream broke" in events[-1].response.error.message
