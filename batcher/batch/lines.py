"""One batch line through the same path as a live request: validate, tokenize, fit the context,
admit against the tenant's budget and the queue at batch priority, run on the engine, and shape
the answer exactly as the live endpoint would (OpenAI's output-file line around it).

A refusal that says "later" (429 budget, 503 queue or SLO, 409 an earlier attempt still being
aborted) raises `Deferred`: the line stays pending and runs again after `retry_after`. Anything
the line itself got wrong is its answer: a 4xx body in the error file, as OpenAI does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from batcher.batch.records import new_id
from batcher.http.errors import ApiError
from batcher.server.gateway import Gateway, Job
from batcher.server.openai_routes import GenerationHandler
from batcher.server.protocol import parse_generation
from batcher.admission.tenants import TenantConfig

# Statuses that mean "not now" rather than "never": the line is retried, not answered.
TRANSIENT = frozenset({409, 429, 503})


class Deferred(Exception):
    """The line could not start now; try again after `retry_after` seconds."""

    def __init__(self, retry_after: float, reason: str):
        super().__init__(reason)
        self.retry_after = max(0.05, retry_after)
        self.reason = reason


@dataclass(slots=True)
class LineResult:
    """A line's answer: HTTP status, the response body, and tokens served (prompt + output)."""

    status_code: int
    body: dict[str, Any]
    tokens: int = 0
    request_id: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


def output_line(custom_id: str, result: LineResult) -> bytes:
    """The output-file line for an answered request (OpenAI's batch output format)."""
    line_id = new_id("batch_req_")
    return orjson.dumps({
        "id": line_id, "custom_id": custom_id,
        "response": {"status_code": result.status_code,
                     "request_id": result.request_id or line_id, "body": result.body},
        "error": None})


def unanswered_line(custom_id: str, code: str, message: str) -> bytes:
    """The error-file line for a request that never ran (batch cancelled or expired)."""
    return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                         "error": {"code": code, "message": message}})


class LineRunner:
    """Runs lines against a gateway (the server's, or the offline runner's own)."""

    def __init__(self, gw: Gateway):
        self.gw = gw
        self._handlers = {"/v1/chat/completions": GenerationHandler(gw, chat=True),
                          "/v1/completions": GenerationHandler(gw, chat=False)}
        self._jobs: dict[str, Job] = {}  # request id -> the admitted job of a running line

    def in_prefill(self, request_id: str) -> bool:
        """The line is admitted and some of its engine requests have no first token yet: its
        prompt is still queued or being prefilled, ahead of anything that arrives now."""
        job = self._jobs.get(request_id)
        return job is not None and any(r.first_token_time is None for r in job.requests)

    def steps_left(self, request_id: str) -> int | None:
        """Decode steps the line has left at most (its longest choice's), None when it is not
        in the engine."""
        job = self._jobs.get(request_id)
        if job is None or not job.requests:
            return None
        return max(r.sampling.max_tokens - r.num_output_tokens for r in job.requests)

    async def run(self, tenant: TenantConfig, url: str, body: dict[str, Any], request_id: str
                  ) -> LineResult:
        """Answer one line. Raises `Deferred` when it must wait; cancelling the call aborts the
        line's engine requests (their blocks are freed at the next step)."""
        try:
            if url == "/v1/embeddings":
                result = await self._embed(tenant, body, request_id)
            else:
                result = await self._generate(tenant, url, body, request_id)
        except ApiError as err:
            if err.status in TRANSIENT:
                raise Deferred(err.retry_after or 1.0, err.code or str(err.status)) from None
            return LineResult(err.status, err.body(), 0, request_id)
        result.request_id = request_id
        return result

    async def _generate(self, tenant: TenantConfig, url: str, body: dict[str, Any],
                        rid: str) -> LineResult:
        gw = self.gw
        handler = self._handlers[url]
        # The served tool-call format, as the live endpoint reads it: a line's tools are
        # rendered and its calls parsed by the same parser.
        spec = parse_generation(body, handler.chat, {gw.cfg.model_name},
                                gw.tokenizer.vocab_size, gw.tool_parser)
        if spec.stream:  # the input file is checked at upload; kept for the offline runner
            raise ApiError(400, "a batch request cannot stream", param="stream")
        # Whatever the line asks, it runs as batch work: it never competes with live traffic.
        spec.priority = "batch"
        prompts = await gw.tokenize(spec)
        gw.fit_context(spec, prompts)
        job = gw.admit(tenant, spec, prompts, rid)
        # NOTE: a line's first token is no evidence about the TTFT prediction: interactive
        # requests that arrive after it are served first by design, so it comes later than
        # predicted. Compared, it would raise the correction applied to interactive requests
        # (a high quantile: one line is enough), refusing them and closing the gate on the
        # batch for the correction's window.
        job.ticket.predicted_ttft_s = None
        self._jobs[rid] = job
        generated = 0
        try:
            # NOTE: the live endpoint's own collection and response shaping, so a line's answer
            # is byte-for-byte what the same request gets over HTTP.
            choices = await handler._collect(spec, job)
            generated = sum(len(c.tokens) for c in choices)
            answer = handler._whole(spec, rid, choices, job)
        finally:
            del self._jobs[rid]
            gw.release(job, generated or sum(r.num_output_tokens for r in job.requests))
        return LineResult(200, answer, answer["usage"]["total_tokens"])

    async def _embed(self, tenant: TenantConfig, body: dict[str, Any], rid: str
                     ) -> LineResult:
        from batcher.flusher.flusher import Closed, Overloaded
        from batcher.server.embeddings_route import _inputs, embedding_body

        gw = self.gw
        if gw.embedder is None:
            raise ApiError(404, "this server has no embedding model", code="model_not_found")
        model, items, fmt = _inputs(body)
        if model != gw.embedder_name:
            raise ApiError(400, f"model '{model}' is not served here; available: "
                           f"['{gw.embedder_name}']", param="model", code="model_not_found")
        batcher = gw.embedder
        if len(items) > batcher.max_queue:
            raise ApiError(400, f"'input' takes at most {batcher.max_queue} strings on this "
                           "server", param="input")
        if batcher.pending + len(items) > batcher.max_queue:
            raise Deferred(batcher.retry_after(), "embedding queue full")
        scoped = f"{tenant.name}:{rid}"
        tasks = [asyncio.ensure_future(batcher.submit(x, request_id=f"{scoped}:{i}"))
                 for i, x in enumerate(items)]
        try:
            vectors = await asyncio.gather(*tasks)
        except Overloaded as exc:
            raise Deferred(exc.retry_after, "embedding queue full") from None
        except Closed:
            raise Deferred(1.0, "shutting down") from None
        finally:
            for t in tasks:
                t.cancel()
        tokens = sum(gw.embedder_tokens(items))
        return LineResult(200, embedding_body(model, vectors, fmt, tokens), tokens)

