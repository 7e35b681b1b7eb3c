"""A streaming client for OpenAI-compatible /v1/completions and /v1/chat/completions.

Timings come from when SSE chunks arrive at the client, so they include the network, the server's
HTTP layer and its detokenizer, as a user would see them. A chunk may carry several tokens (a
detokenizer holding back half a UTF-8 character, say), so inter-token latencies are between chunks
that carry text, and the token count comes from the server's `usage` when it reports one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import orjson

from batcher.bench.workload import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Statuses a client sends again after the server's Retry-After (capacity that comes back).
RETRY_STATUSES = frozenset({429, 503})
# As OpenAI's SDKs: a Retry-After above this is not waited for (their backoff is used instead);
# without one, 0.5 s doubling per retry up to 8 s, less up to a quarter of jitter.
MAX_RETRY_AFTER_S = 60.0
BACKOFF_BASE_S, BACKOFF_MAX_S = 0.5, 8.0


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    priority: str | None = None
    # "ids": send token ids (exact prompt lengths, no tokenizer differences); "text": send text.
    prompt_mode: str = "ids"
    request_timeout: float = 600.0
    # Times a request refused with 429/503 is sent again, after the server's Retry-After, as
    # OpenAI's client does (`max_retries`); 0 counts every refusal as it comes.
    max_retries: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}")
        if self.max_retries < 0:
            raise ValueError("max retries must be >= 0")
        if self.prompt_mode not in ("ids", "text"):
            raise ValueError("prompt mode must be 'ids' or 'text'")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.priority:
            body["priority"] = self.priority
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt_text or ""}]
        elif self.prompt_mode == "ids" and req.prompt_ids is not None:
            body["prompt"] = req.prompt_ids
        else:
            body["prompt"] = req.prompt_text or ""
        return body


@dataclass(slots=True)
class RequestResult:
    """One request's outcome; times in seconds, `start` from the run's start, others from send."""

    id: str
    prompt_len: int
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    tokens_from: str = "chunks"
    chunks: int = 0
    status: int = 0
    error: str | None = None
    retry_after: str | None = None
    timings: dict[str, Any] | None = None  # the server's phase split, from the usage chunk
    reconnected: bool = False  # sent again after its kept-alive connection turned out closed
    attempts: int = 1  # sends, counting those refused with 429/503 and sent again
    # Each refusal (429/503, the retried ones included) as "STATUS REASON": the server's
    # `X-Reject-Reason`, else its error body's code, else "unknown".
    refusals: list[str] = field(default_factory=list)
    retry_wait_s: float = 0.0  # time spent waiting to send again, as Retry-After asked

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def kind(self) -> str:
        """'ok', the HTTP status ('429', '503', ...), 'stream_error', 'timeout' or 'connection'."""
        if self.ok:
            return "ok"
        if self.status == 200:
            return "stream_error"
        if self.status:
            return str(self.status)
        return "timeout" if self.error == "timeout" else "connection"

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def length_ok(self) -> bool:
        return self.ok and self.output_tokens == self.max_tokens

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, kind=self.kind, tpot=self.tpot, length_ok=self.length_ok)
        return d


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        parts.append((delta.get("content") if delta else choice.get("text")) or "")
    return "".join(parts)


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, sent: float) -> None:
    last: float | None = None
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators and ": keep-alive" comments
        data = line[5:].strip()
        now = time.perf_counter()
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            res.error = f"stream error after {res.chunks} chunks: {msg}"
            break
        usage = chunk.get("usage")
        if isinstance(chunk.get("timings"), dict):
            res.timings = chunk["timings"]
        if usage and usage.get("completion_tokens") is not None:
            res.output_tokens = int(usage["completion_tokens"])
            res.tokens_from = "usage"
        if any(c.get("finish_reason") for c in chunk.get("choices") or ()):
            finished = True
        if _chunk_text(chunk):
            res.chunks += 1
            if last is None:
                res.ttft = now - sent
            else:
                res.itl.append(now - last)
            last = now
        elif finished and res.ttft is None:
            # Only empty text came back (tokens that decode to nothing): the finish is the first
            # sign of output a user gets.
            res.ttft = now - sent
    res.e2e = time.perf_counter() - sent
    if res.tokens_from != "usage":
        res.output_tokens = res.chunks
    if res.error is None and not finished:
        res.error = "the stream ended without a finish reason"


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, req: BenchRequest,
                       t0: float) -> RequestResult:
    """Send one streaming request; never raises for a server's or the network's failure."""
    res = RequestResult(req.id, req.prompt_len, req.max_tokens)
    payload = orjson.dumps(cfg.body(req))
    sent = time.perf_counter()
    res.start = sent - t0
    try:
        # Times stay measured from the first send: a retried request's wait is the user's too.
        async with asyncio.timeout(cfg.request_timeout):
            await _exchange(session, cfg, payload, res, sent)
            while res.status in RETRY_STATUSES and res.attempts <= cfg.max_retries:
                wait = retry_delay(res.retry_after, res.attempts)
                res.retry_wait_s += wait
                await asyncio.sleep(wait)
                res.attempts += 1
                res.status, res.error, res.retry_after, res.e2e = 0, None, None, None
                await _exchange(session, cfg, payload, res, sent)
    except TimeoutError:
        res.status, res.error = 0, "timeout"
    except (aiohttp.ClientError, ConnectionError, orjson.JSONDecodeError) as exc:
        res.status, res.error = 0, f"{type(exc).__name__}: {exc}"
    if res.e2e is None:
        res.e2e = time.perf_counter() - sent
    return res


async def _exchange(session: aiohttp.ClientSession, cfg: ClientConfig, payload: bytes,
                    res: RequestResult, sent: float) -> None:
    for attempt in range(2):
        try:
            async with session.post(cfg.url, data=payload, headers=cfg.headers()) as resp:
                res.status = resp.status
                if resp.status != 200:
                    res.retry_after = resp.headers.get("Retry-After")
                    res.error, code = _error_message(await resp.text())
                    if resp.status in RETRY_STATUSES:
                        why = resp.headers.get("X-Reject-Reason") or code or "unknown"
                        res.refusals.append(f"{resp.status} {why[:64]}")
                    res.e2e = time.perf_counter() - sent
                    return
                await _read_stream(resp, res, sent)
                return
        except aiohttp.ClientConnectorError:
            raise  # no connection at all: nothing stale to replace
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # A kept-alive connection that the server closed after its last response fails
            # before anything comes back: sent again once, on a new connection, as HTTP clients
            # do for a reused connection. A server that drops the new one too is an error.
            if attempt or res.status:
                raise
            res.reconnected = True


def retry_delay(retry_after: str | None, retry: int, rand: float | None = None) -> float:
    """Seconds to wait before sending again the `retry`-th time (from 1): the server's
    Retry-After (seconds or an HTTP date) when it names one of at most a minute, else backoff."""
    if retry_after is not None:
        try:
            wait = float(retry_after)
        except ValueError:
            try:
                wait = parsedate_to_datetime(retry_after).timestamp() - time.time()
            except (TypeError, ValueError, IndexError):
                wait = -1.0
        if 0 <= wait <= MAX_RETRY_AFTER_S:
            return wait
    backoff = min(BACKOFF_BASE_S * 2 ** (retry - 1), BACKOFF_MAX_S)
    return backoff * (1 - 0.25 * (random.random() if rand is None else rand))


def _error_message(text: str) -> tuple[str, str | None]:
    """An error answer's message and its code (None when it has none)."""
    try:
        err = orjson.loads(text).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return text[:200], None
    if isinstance(err, dict):
        code = err.get("code")
        return str(err.get("message", err))[:200], str(code)[:64] if code else None
    return str(err)[:200], None


async def first_model(session: aiohttp.ClientSession, base_url: str,
                      api_key: str | None = None) -> str:
    """The first model a server lists, for when the caller names none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    return str(data["data"][0]["id"])
