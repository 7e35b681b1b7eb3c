"""The gateway's state and the steps every generation request goes through: tokenize, check the
context limit, admit against the tenant's token budget and the queue, register the request ID,
run the engine requests (n choices) and merge their events."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from batcher.admission.admission import Admission, Rejected, Ticket
from batcher.core.refusals import Refused
from batcher.engine.engine import AsyncEngine
from batcher.engine.events import EngineEvent
from batcher.engine.snapshot import EngineSnapshot
from batcher.http.errors import ApiError, invalid
from batcher.http.listener import read_body, read_json
from batcher.engine.metrics import Metrics
from batcher.core.request import Priority, Request
from batcher.server.auth import Authenticator
from batcher.server.grammar_cooldown import grammar_cooldown
from batcher.server.malformed_cooldown import MALFORMED_CODES, malformed_cooldown
from batcher.server.oversize_cooldown import OVERSIZE_BYTES, oversize_cooldown
from batcher.server.protocol import GenerationSpec
from batcher.server.reasoning import get_reasoning_parser
from batcher.server.tool_parsers import get_parser
from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig
from batcher.tokenizer.tokenizer import message_chars

log = logging.getLogger(__name__)
T = TypeVar("T")

# prompts x n of one request: each is an engine request, and the queue bound counts requests.
MAX_CHOICES = 64
# Prompt logprobs (`echo` with `logprobs`) one request may ask for: scored prompt positions x
# (1 + alternatives), over every choice. Each entry costs a few hundred bytes until the answer is
# written, so without a bound 64 choices of a full-context prompt at 20 alternatives (11M entries)
# would hold gigabytes for one small body. This allows a full 8,192-token prompt at 20
# alternatives three times over, or 64 prompts of 4,000 tokens at one alternative.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
# Tokenize text this long in a worker thread so the event loop keeps answering.
TOKENIZE_OFFLOAD_CHARS = 20_000


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    default_max_tokens: int = 1024
    max_body_bytes: int = 4 * 2**20
    tool_call_parser: str = "generic"  # see batcher.server.tool_parsers
    reasoning_parser: str | None = None  # see batcher.server.reasoning
    # What /v1/models says of the model: architecture, context_length, quantization, dtype.
    model_info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Job:
    """One admitted client request: its ticket and the engine requests (one per choice)."""

    key: tuple[str, str]  # (tenant, client request id)
    ticket: Ticket
    requests: list[Request] = field(default_factory=list)
    cooldown_key: str | None = None  # whose cool-downs it counts against (`cooldown_key`)


def cooldown_key(request: web.Request) -> str | None:
    """Whose cool-down a request counts against: its tenant, or where a server has no tenants
    of its own (auth off, or `--api-key`'s one tenant for every key) the tenant and the
    client's address, so that one abusive client does not cool down every other."""
    tenant = request.get("tenant")
    if tenant is None:
        return None
    if tenant.name == DEFAULT_TENANT.name:
        return f"{tenant.name}@{request.remote}"
    return tenant.name


class Gateway:
    """Everything the handlers share. Lives on the event loop; no locks needed."""

    def __init__(self, cfg: GatewayConfig, engine: AsyncEngine, auth: Authenticator,
                 admission: Admission, metrics: Metrics, embedder: Any = None,
                 embedder_name: str = "", embedder_tokens: Any = None):
        self.cfg = cfg
        self.engine = engine
        self.grammar_cooldown = grammar_cooldown()
        self.oversize_cooldown = oversize_cooldown()
        self.malformed_cooldown = malformed_cooldown()
        self.tokenizer = engine.tokenizer
        self.tool_parser = get_parser(cfg.tool_call_parser, self.tokenizer.chat_template)
        self.reasoning = get_reasoning_parser(cfg.reasoning_parser)
        self.auth = auth
        self.admission = admission
        self.metrics = metrics
        self.embedder = embedder  # a Flusher over the embedding model, or None
        self.embedder_name = embedder_name
        self.embedder_tokens = embedder_tokens  # texts -> token counts
        self.jobs: dict[tuple[str, str], Job] = {}
        self.tokenizing: dict[str, int] = {}  # tenant -> tokenizer jobs in worker threads
        self.draining = False
        self.started_at = time.time()

    # state ---------------------------------------------------------------------------------
    def state(self) -> EngineSnapshot:
        """The replica's snapshot: `/v1/state`, `X-Replica-State` and the admin status."""
        return self.engine.snapshot(draining=self.draining, in_flight=len(self.jobs))

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        st = self.engine.snapshot()
        if not st.healthy:
            return False, st.error or "engine unhealthy"
        return True, "ready"

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self.admission.set_draining(draining)

    # steps of a generation request ------------------------------------------------------------
    async def tokenize(self, spec: GenerationSpec,
                       tenant: TenantConfig | None = None) -> list[list[int]]:
        # NOTE: count before tokenizing: 800k one-letter prompts are 3 MiB of JSON but seconds
        # of tokenizer time, all to be refused.
        self.check_choices(len(spec.prompts) or 1, spec.n)
        self.check_text_fits(spec)

        def work() -> list[list[int]]:
            if spec.chat:
                return [self.tokenizer.apply_chat_template(
                    spec.messages, tools=spec.chat_tools, template_kwargs=spec.template_kwargs)]
            return [p if isinstance(p, list) else self.tokenizer.encode(p) for p in spec.prompts]

        size = sum(len(p) for p in spec.prompts if isinstance(p, str)) + len(
            str(spec.messages or ""))
        try:
            if size > TOKENIZE_OFFLOAD_CHARS:
                out = await self.off_loop(tenant, work)
            else:
                out = work()
        except ValueError as exc:
            raise invalid(str(exc), "messages" if spec.chat else "prompt") from exc
        for ids in out:
            if not ids:
                raise invalid("the prompt is empty", "messages" if spec.chat else "prompt")
        return out

    async def read_request(self, request: web.Request) -> Any:
        """The request's body as JSON. A caller cooling down after a flood of malformed requests
        is refused before its body is read (`malformed_cooldown`); one cooling down after a very
        large body was refused for its length is refused its next very large bodies before they
        are read (`oversize_cooldown`): over `OVERSIZE_BYTES` on the wire, of unknown length, or
        compressed (whose size read is not the size sent). The size read is kept for
        `note_refusal`."""
        key = cooldown_key(request)
        length = request.content_length
        if key is not None and request.body_exists:
            self.malformed_cooldown.check(key)
            if (length is None or length > OVERSIZE_BYTES
                    or "Content-Encoding" in request.headers):
                self.oversize_cooldown.check(key)
        raw = await read_body(request)
        request["body_bytes"] = len(raw)
        return await read_json(request, raw)

    def note_refusal(self, request: web.Request, err: ApiError) -> None:
        """A request refused: one refused as malformed counts towards its caller's
        `malformed_cooldown`; one whose body read over `OVERSIZE_BYTES` was refused as longer
        than the context starts its `oversize_cooldown`."""
        key = cooldown_key(request)
        if key is None:
            return
        if err.status == 400 and err.code in MALFORMED_CODES:
            self.malformed_cooldown.note(key)
        if (err.code == "context_length_exceeded"
                and request.get("body_bytes", 0) > OVERSIZE_BYTES):
            self.oversize_cooldown.note(key)

    def check_text_fits(self, spec: GenerationSpec) -> None:
        """Refuse at once a prompt whose text alone is longer than the context can hold, however
        it tokenizes (`Tokenizer.min_tokens`): tokenizing megabytes costs seconds of CPU."""
        chars = max([len(p) for p in spec.prompts if isinstance(p, str)]
                    + [message_chars(spec.messages) if spec.chat else 0])
        least = self.tokenizer.min_tokens(chars)
        out = spec.sampling.max_tokens if spec.max_tokens_given or not spec.chat else 1
        if least + out > self.cfg.max_model_len:
            raise ApiError(400, f"this model's context is {self.cfg.max_model_len} tokens; the "
                           f"prompt's {chars} characters are at least {least} tokens",
                           param="messages" if spec.chat else "prompt",
                           code="context_length_exceeded")

    async def off_loop(self, tenant: TenantConfig | None, work: Callable[[], T]) -> T:
        """Run tokenizer work in a thread (the tokenizer releases the interpreter while it
        encodes), counted against the tenant's concurrency: a caller cannot queue unbounded
        CPU work behind its own requests."""
        if tenant is not None:
            busy = self.tokenizing.get(tenant.name, 0)
            if busy + self.admission.in_flight(tenant.name) >= tenant.max_concurrent:
                self.metrics.observe_rejected("tenant_concurrency", 1)
                raise ApiError(429, f"too many concurrent requests (limit "
                               f"{tenant.max_concurrent})", code="tenant_concurrency",
                               retry_after=1, headers={"X-Reject-Reason": "tenant_concurrency"})
            self.tokenizing[tenant.name] = busy + 1
        try:
            return await asyncio.get_running_loop().run_in_executor(None, work)
        finally:
            if tenant is not None:
                left = self.tokenizing[tenant.name] - 1
                if left:
                    self.tokenizing[tenant.name] = left
                else:
                    del self.tokenizing[tenant.name]

    def fit_context(self, spec: GenerationSpec, prompts: list[list[int]]) -> None:
        """Check prompt + max_tokens against the context; fill a default max_tokens for chat."""
        limit = self.cfg.max_model_len
        longest = max(len(p) for p in prompts)
        if not spec.max_tokens_given and spec.chat:
            spec.sampling.max_tokens = max(1, min(self.cfg.default_max_tokens, limit - longest))
        k = spec.sampling.prompt_logprobs
        if k is not None:
            entries = sum(max(0, len(p) - 1) for p in prompts) * spec.n * (1 + k)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise invalid(f"prompt logprobs ('echo' with 'logprobs') are limited to "
                              f"{MAX_PROMPT_LOGPROB_ENTRIES} entries per request (scored prompt "
                              f"tokens x n x (1 + logprobs)); this one asks for {entries}: send "
                              "fewer or shorter prompts, a smaller n or fewer logprobs",
                              "logprobs", "prompt_logprobs_too_large")
        need = longest + spec.sampling.max_tokens
        if need > limit:
            raise ApiError(400, f"this model's context is {limit} tokens; the prompt has "
                           f"{longest} and max_tokens is {spec.sampling.max_tokens} "
                           f"({need} in all)", param="max_tokens",
                           code="context_length_exceeded")

    @staticmethod
    def check_choices(prompts: int, copies: int) -> None:
        if prompts * copies > MAX_CHOICES:
            raise invalid(f"one request may ask for at most {MAX_CHOICES} completions "
                          f"(prompts x n); this one asks for {prompts * copies}", "n")

    def admit(self, tenant: TenantConfig, spec: GenerationSpec, prompts: list[list[int]],
              client_id: str) -> Job:
        key = (tenant.name, client_id)
        copies = spec.n
        self.check_choices(len(prompts), copies)
        engine_ids = [f"{tenant.name}:{client_id}:{i}" for i in range(len(prompts) * copies)]
        # NOTE: a cancelled or disconnected request leaves `jobs` at once but stays in the engine
        # until its abort is applied at the next step; reusing its ID in that window must be a
        # 409 too, not a scheduler error.
        if key in self.jobs or any(self.engine.owns(r) for r in engine_ids):
            raise ApiError(409, f"request id '{client_id}' is already in flight",
                           param="X-Request-Id", code="duplicate_request_id", retry_after=1)
        prompt_tokens = sum(len(p) for p in prompts) * copies
        max_tokens = spec.sampling.max_tokens * len(prompts) * copies
        backlog = self.engine.backlog()
        try:
            ticket = self.admission.admit(tenant, spec.priority, prompt_tokens, max_tokens,
                                          backlog, len(prompts) * copies)
        except Rejected as rej:
            self.metrics.observe_rejected(rej.reason, float(rej.retry_after_header))
            # NOTE: the reason travels in the body's code, the access line and a header, so a
            # client, an operator and a router each read why without parsing the message.
            raise ApiError(rej.status, rej.message, code=rej.reason,
                           retry_after=rej.retry_after,
                           headers={"X-Reject-Reason": rej.reason}) from None
        except Refused as exc:
            raise invalid(str(exc), exc.param) from None
        job = Job(key, ticket)
        prio = Priority.BATCH if spec.priority == "batch" else Priority.INTERACTIVE
        for i, ids in enumerate(p for p in prompts for _ in range(copies)):
            sp = copy.copy(spec.sampling)
            sp.stop = list(sp.stop)
            if sp.seed is not None:
                sp.seed += i  # n choices with one seed must still differ
            job.requests.append(Request(engine_ids[i], ids, sp, tenant=tenant.name,
                                        priority=prio))
        self.jobs[key] = job
        return job

    def release(self, job: Job, generated: int) -> None:
        if self.jobs.get(job.key) is job:
            del self.jobs[job.key]
        self.admission.release(job.ticket, generated)
        first = job.requests[0] if job.requests else None
        if first is not None and first.finished_time and first.first_scheduled_time:
            # Mean service time per request: the concurrency 429's Retry-After.
            self.admission.observe_service(first.finished_time - first.first_scheduled_time)

    def cancel(self, tenant: str, client_id: str) -> bool:
        job = self.jobs.get((tenant, client_id))
        if job is None:
            return False
        for r in job.requests:
            self.engine.abort(r.request_id)
        return True

    async def events(self, job: Job) -> AsyncIterator[tuple[int, EngineEvent]]:
        """(choice index, event) for every choice of the job, as they come. Leaving early
        aborts every choice still running."""
        if len(job.requests) == 1:
            async for ev in self.engine.generate(job.requests[0]):
                if ev.token_ids:
                    self.admission.observe_first_token(job.ticket)
                yield 0, ev
            return
        merged: asyncio.Queue[tuple[int, EngineEvent | BaseException]] = asyncio.Queue()

        async def pump(i: int, req: Request) -> None:
            try:
                async for ev in self.engine.generate(req):
                    merged.put_nowait((i, ev))
            except Exception as exc:  # noqa: BLE001 (surfaced to the reader below)
                merged.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(job.requests)]
        try:
            done = 0
            while done < len(tasks):
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                if item.token_ids:
                    self.admission.observe_first_token(job.ticket)
                if item.finished:
                    done += 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
