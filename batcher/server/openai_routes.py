"""POST /v1/completions and /v1/chat/completions: whole answers and SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from batcher.core.outputs import TokenLogprobs
from batcher.engine.events import EngineError, EngineEvent
from batcher.http.errors import ApiError, invalid
from batcher.http.sse import SEP, SSE_HEADERS
from batcher.server.choice_tally import Choice, UsageTally, score_only
from batcher.server.chunk_sink import SSE_CHUNKS, ChunkSink
from batcher.server.gateway import Gateway, Job, cooldown_key
from batcher.server.generation_errors import deadline_error, engine_refusal, final_error
from batcher.server.grammar_cooldown import asks_for_grammar
from batcher.server.logprobs_format import chat_logprobs, echo_logprobs, legacy_logprobs
from batcher.server.protocol import GenerationSpec, now_s, parse_generation
from batcher.server.reasoning import ReasoningStream
from batcher.server.timing import RequestTiming
from batcher.server.tool_parsers import ToolStream


class GenerationHandler:
    def __init__(self, gw: Gateway, chat: bool):
        self.gw = gw
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.prefix = "chatcmpl-" if chat else "cmpl-"

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        timing = RequestTiming(self.gw.metrics, request, self.gw.engine)
        try:
            resp = await self._handle(request, timing)
        except ApiError as err:
            self.gw.note_refusal(request, err)
            if timing.job is not None and self.gw.engine.stopping:
                timing.cut("shutdown")
            timing.done(err.status, err.code)
            raise
        except asyncio.CancelledError:  # the client went away, or shutdown cut the request
            if timing.outcome is None:
                timing.cut(self.gone())
            timing.done(499)
            raise
        except Exception:
            timing.done(500)
            raise
        timing.done(resp.status)
        return resp

    async def _handle(self, request: web.Request, timing: RequestTiming) -> web.StreamResponse:
        gw = self.gw
        body = await gw.read_request(request)
        if asks_for_grammar(body):  # before its grammar is compiled
            gw.grammar_cooldown.check(cooldown_key(request))
        await self.load(request, body)
        spec = self.parse(request, body)
        if spec.sampling.grammar is not None and not gw.engine.supports_grammar:
            raise invalid("structured outputs are not supported by this model",
                          "response_format", "unsupported")
        if spec.sampling.prompt_logprobs is not None and not gw.engine.scores_prompts:
            raise invalid("prompt logprobs ('echo' with 'logprobs') are not supported by this "
                          "model", "echo", "unsupported")
        if spec.sampling.grammar is not None:
            gw.grammar_cooldown.check(cooldown_key(request))
        timing.marks.mark_parsed()
        prompts = await gw.tokenize(spec, request["tenant"])
        gw.fit_context(spec, prompts)
        timing.marks.mark_tokenized()
        tenant = request["tenant"]
        rid: str = request["request_id"]
        job = gw.admit(tenant, spec, prompts, rid)
        job.cooldown_key = cooldown_key(request)
        timing.job = job
        timing.copies = spec.n
        generated = 0
        try:
            if spec.stream:
                return await self._stream(request, spec, job, timing)
            choices = await self._collect(spec, job)
            generated = sum(len(c.tokens) for c in choices)
            answer = self._whole(spec, rid, choices, job)
            t = timing.finish([c.final for c in choices], answer["usage"])
            answer["timings"] = t.to_json()
            headers = {"Server-Timing": t.server_timing()}
            if (state := request["state_header"]()) is not None:
                headers["X-Replica-State"] = state
            answer = await self.shape(request, answer)
            return web.Response(body=orjson.dumps(answer), content_type="application/json",
                                headers=headers)
        finally:
            gw.release(job, generated or sum(r.num_output_tokens for r in job.requests))

    def _note_grammar_cut(self, job: Job, err: ApiError) -> None:
        if err.code == "grammar_too_costly" and job.cooldown_key is not None:
            self.gw.grammar_cooldown.note(job.cooldown_key)

    def gone(self) -> str:
        """Why a request still running was cut: the server shutting down, or its client."""
        return "shutdown" if self.gw.engine.stopping else "client_disconnect"

    # hooks: the routes that translate another API onto this one override them ------------------
    async def load(self, request: web.Request, body: Any) -> None:
        """What `parse` needs that takes I/O (a stored response), fetched off the event loop."""

    def parse(self, request: web.Request, body: Any) -> GenerationSpec:
        """The request's spec from its JSON body; ApiError(400) naming the field."""
        gw = self.gw
        return parse_generation(body, self.chat, {gw.cfg.model_name}, gw.tokenizer.vocab_size,
                                gw.tool_parser)

    async def shape(self, request: web.Request, answer: dict[str, Any]) -> dict[str, Any]:
        """The whole answer's body from the chat or completion answer."""
        return answer

    def sink(self, request: web.Request, spec: GenerationSpec, job: Job) -> ChunkSink:
        """What a stream sends for each chunk and at its end."""
        return SSE_CHUNKS

    # whole answers -----------------------------------------------------------------------------
    async def _collect(self, spec: GenerationSpec, job: Job) -> list[Choice]:
        choices = [Choice() for _ in job.requests]
        try:
            async with asyncio.timeout(spec.timeout):
                async for i, ev in self.gw.events(job):
                    c = choices[i]
                    if spec.score_only:
                        ev = score_only(ev)
                    if ev.prompt_logprobs is not None:
                        c.prompt_logprobs = ev.prompt_logprobs
                    c.text.append(ev.text)
                    c.tokens += ev.token_ids
                    c.logprobs += ev.logprobs
                    if ev.finished:
                        c.final = ev
        except TimeoutError:
            raise deadline_error(spec) from None
        except (ValueError, EngineError) as exc:
            raise engine_refusal(exc) from None
        for c in choices:
            err = final_error(c.final) if c.final is not None else None
            if err is not None:
                self._note_grammar_cut(job, err)
                raise err
        return choices

    def _whole(self, spec: GenerationSpec, rid: str, choices: list[Choice], job: Job
               ) -> dict[str, Any]:
        out = []
        tally = UsageTally(spec.n)
        for i, c in enumerate(choices):
            fin = c.final
            assert fin is not None
            text = "".join(c.text)
            lp = self._logprobs(spec, c.tokens, c.logprobs, text)
            if spec.echo and spec.logprobs is not None:
                lp = echo_logprobs(self.gw.tokenizer, job.requests[i].prompt_token_ids,
                                   c.prompt_logprobs, lp)
            item: dict[str, Any] = {"index": i, "logprobs": lp,
                                    "finish_reason": fin.finish_reason}
            thinking = self.gw.reasoning if self.chat else None
            if thinking is not None:
                reasoning, text = thinking.parse(text)
            content, calls = self.gw.tool_parser.parse(text, spec.tools) if (
                self.chat and spec.tools.active) else (text, None)
            if calls:
                item["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                if fin.finish_reason == "stop":
                    item["finish_reason"] = "tool_calls"
            elif self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = self._echo(spec, i) + text
            if thinking is not None:
                item["message"]["reasoning_content"] = reasoning
            if fin.stop_reason is not None:
                item["stop_reason"] = fin.stop_reason
            if spec.return_token_ids:
                item["token_ids"] = c.tokens
            out.append(item)
            tally.add(i, fin)
        return {"id": self.prefix + rid, "object": self.object, "created": now_s(),
                "model": spec.model, "choices": out, "usage": tally.body()}

    # streams -------------------------------------------------------------------------------
    async def _stream(self, request: web.Request, spec: GenerationSpec, job: Job,
                      timing: RequestTiming) -> web.StreamResponse:
        """Status and headers once the first event is in, then one SSE chunk per event; the
        deadline, the engine's failure and the client's disconnect each end it explicitly."""
        rid = request["request_id"]
        sink = self.sink(request, spec, job)
        resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": rid})
        events = self.gw.events(job)
        try:
            async with asyncio.timeout(spec.timeout) as deadline:
                first = await self._first_event(events)
                # The headers leave now: the state they carry is the replica's now, not at
                # admission (a router routes the next requests on it).
                if (state := request["state_header"]()) is not None:
                    resp.headers["X-Replica-State"] = state
                await resp.prepare(request)
                base = {"id": self.prefix + rid, "object": self.object + ".chunk"
                        if self.chat else self.object, "created": now_s(), "model": spec.model}
                await self._relay(resp, spec, job, base, first, events, timing, sink)
                deadline.reschedule(None)
        except TimeoutError:
            if not resp.prepared:
                raise deadline_error(spec) from None
            timing.cut("deadline")
            err = deadline_error(spec)
            err.param = None
            with contextlib.suppress(ConnectionError):
                await resp.write(sink.chunk(err.body()))
        except ConnectionError:
            # The client went away mid-stream: a normal end, not a server error. aclose() below
            # aborts every choice still running, which frees their KV blocks at the next step.
            # What ran is read first, while the engine still holds the choices.
            timing.cut(self.gone())
        except asyncio.CancelledError:
            timing.cut(self.gone())
            raise
        finally:
            await events.aclose()
        with contextlib.suppress(ConnectionError):
            await resp.write(await sink.end())
            await resp.write_eof()
        return resp

    @staticmethod
    async def _first_event(events: AsyncIterator[tuple[int, EngineEvent]]
                           ) -> tuple[int, EngineEvent]:
        """NOTE: a request the engine refuses must fail with a status, before any byte is sent."""
        try:
            return await anext(events)
        except (ValueError, EngineError) as exc:
            raise engine_refusal(exc) from None

    async def _relay(self, resp: web.StreamResponse, spec: GenerationSpec, job: Job,
                     base: dict[str, Any], first: tuple[int, EngineEvent],
                     events: AsyncIterator[tuple[int, EngineEvent]], timing: RequestTiming,
                     sink: ChunkSink = SSE_CHUNKS) -> None:
        """Write every choice's events as chunks, then the usage chunk when asked for; an
        engine failure ends the stream with an error event instead."""
        if self.chat:
            for i in range(len(job.requests)):
                await resp.write(sink.chunk(self._chunk(base, i, role=True)))
        elif spec.echo and spec.logprobs is None:
            for i in range(len(job.requests)):
                await resp.write(sink.chunk(self._chunk(base, i, text=self._echo(spec, i))))
        # With logprobs, a choice's echo waits for its prompt logprobs (on its first event).
        echo_due = set(range(len(job.requests))) if spec.echo and spec.logprobs is not None \
            else set()
        tally = UsageTally(spec.n)
        finals: list[EngineEvent | None] = [None] * len(job.requests)
        prompt_sent: set[int] = set()
        buffers = ({i: self.gw.tool_parser.stream(spec.tools) for i in range(len(job.requests))}
                   if self.chat and spec.tools.active else None)
        thinking = ({i: self.gw.reasoning.stream() for i in range(len(job.requests))}
                    if self.chat and self.gw.reasoning is not None else None)
        # NOTE: most chunks carry text alone: with nothing else asked for, they are written from
        # bytes made once per choice around the text's JSON (the same bytes as the chunk's).
        plain = sink is SSE_CHUNKS and not (spec.score_only or echo_due or buffers is not None
                     or spec.logprobs is not None or spec.return_token_ids
                     or thinking is not None)
        frames: dict[int, tuple[bytes, bytes]] = {}
        dumps = orjson.dumps
        item: tuple[int, EngineEvent] | None = first
        while item is not None:
            i, ev = item
            if plain and ev.text and ev.finish_reason is None and ev.prompt_logprobs is None:
                frame = frames.get(i)
                if frame is None:
                    frame = frames[i] = self._text_frame(base, i)
                await resp.write(frame[0] + dumps(ev.text) + frame[1])
                item = await anext(events, None)
                continue
            err = final_error(ev)
            if err is not None:
                self._note_grammar_cut(job, err)
                finals[i] = ev
                timing.cut("shutdown" if self.gw.engine.stopping else "error", finals)
                await resp.write(sink.chunk(self._error(err, ev)))
                return
            if spec.score_only:
                ev = score_only(ev)
            if i in echo_due and ev.prompt_logprobs is not None:
                echo_due.discard(i)
                lp = echo_logprobs(self.gw.tokenizer, job.requests[i].prompt_token_ids,
                                   ev.prompt_logprobs)
                await resp.write(sink.chunk(self._chunk(base, i, text=self._echo(spec, i),
                                                       logprobs=lp)))
            chunk = self._event_chunk(base, spec, job, i, ev, prompt_sent, buffers, thinking)
            if chunk is not None:
                await resp.write(sink.chunk(chunk))
            if ev.finished:
                tally.add(i, ev)
                finals[i] = ev
            item = await anext(events, None)
        # The usage chunk is the stream's last word: its timings end as it is written; without
        # it they end when the last choice's chunk was written.
        t = timing.finish(finals, tally.body())
        if spec.include_usage:
            await resp.write(sink.chunk(dict(base, choices=[], usage=tally.body(),
                                            timings=t.to_json())))

    def _event_chunk(self, base: dict[str, Any], spec: GenerationSpec, job: Job, i: int,
                     ev: EngineEvent, prompt_sent: set[int],
                     buffers: dict[int, ToolStream] | None = None,
                     thinking: dict[int, ReasoningStream] | None = None
                     ) -> dict[str, Any] | None:
        """The chunk for one event, or None when it carries nothing a client would see. With
        tools, text that may open a call is held back, and calls go out as `tool_calls`
        deltas while they are generated: a call's first names it, later ones carry its
        arguments' text."""
        lp = self._logprobs(spec, ev.token_ids, ev.logprobs, ev.text)
        ids = ev.token_ids if spec.return_token_ids else None
        text, deltas, reasoning = ev.text, [], ""
        if thinking is not None:  # the think block, split off before tool calls are read
            reasoning, text = thinking[i].feed(text)
            if ev.finished:
                more_reasoning, rest = thinking[i].end()
                reasoning, text = reasoning + more_reasoning, text + rest
        if buffers is not None:
            text, deltas = buffers[i].feed(text)
            if ev.finished:
                rest, more = buffers[i].end()
                text, deltas = text + rest, deltas + more
        if not (text or deltas or reasoning or ev.finished or lp or ids):
            return None
        called = buffers is not None and buffers[i].called
        finish = "tool_calls" if called and ev.finish_reason == "stop" else ev.finish_reason
        chunk = self._chunk(base, i, text=text, logprobs=lp, finish=finish,
                            stop_reason=ev.stop_reason, token_ids=ids)
        if deltas:
            chunk["choices"][0]["delta"]["tool_calls"] = deltas
        if reasoning:
            chunk["choices"][0]["delta"]["reasoning_content"] = reasoning
        if ids is not None and i not in prompt_sent:
            prompt_sent.add(i)  # once per choice: what a resume re-sends
            chunk["prompt_token_ids"] = job.requests[i].prompt_token_ids
        return chunk

    def _text_frame(self, base: dict[str, Any], index: int) -> tuple[bytes, bytes]:
        """The SSE bytes of `_chunk(base, index, text=T)` before and after T's JSON string."""
        head = orjson.dumps(base)[:-1] + b',"choices":[{"index":' + str(index).encode()
        if self.chat:
            return (b"data: " + head + b',"delta":{"content":',
                    b'},"logprobs":null,"finish_reason":null}]}' + SEP)
        return (b"data: " + head + b',"text":',
                b',"logprobs":null,"finish_reason":null}]}' + SEP)

    def _chunk(self, base: dict[str, Any], index: int, text: str = "", role: bool = False,
               logprobs: Any = None, finish: str | None = None,
               stop_reason: str | None = None, token_ids: list[int] | None = None
               ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return dict(base, choices=[choice])

    @staticmethod
    def _error(err: ApiError, ev: EngineEvent) -> dict[str, Any]:
        """The error event that ends a stream the engine failed, with how many tokens it got."""
        body = ApiError(err.status, f"{err.message} after {ev.num_output_tokens} tokens",
                        code=err.code).body()
        body["error"]["tokens_sent"] = ev.num_output_tokens
        return body

    def _echo(self, spec: GenerationSpec, index: int) -> str:
        """The prompt text that leads choice `index` when `echo` is on (n choices per prompt)."""
        if not spec.echo:
            return ""
        prompt = spec.prompts[index // spec.n]
        return prompt if isinstance(prompt, str) else self.gw.tokenizer.decode(prompt)

    # logprobs --------------------------------------------------------------------------------
    def _logprobs(self, spec: GenerationSpec, tokens: list[int],
                  lps: list[TokenLogprobs | None], text: str) -> Any:
        if spec.logprobs is None or not tokens:
            return None
        if self.chat:
            return chat_logprobs(self.gw.tokenizer, tokens, lps)
        return legacy_logprobs(self.gw.tokenizer, tokens, lps)
