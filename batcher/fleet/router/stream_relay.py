"""A streamed generation request across its attempts: committed to the client on its first
event and relayed unbuffered; after a replica fails mid-stream, resumed on another replica or
ended with an explicit error event. The contract is `forward.py`'s; what the client saw is kept
by `stream_ledger.StreamLedger`."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from batcher.fleet.router.forward import Failure, Relay, finish_reason_in
from batcher.fleet.router.registry import Replica
from batcher.http.sse import DONE, SSE_HEADERS
from batcher.http.upstream import UpstreamError


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class StreamRelay(Relay):
    """One streamed client request across its attempts."""

    async def stream(self) -> web.StreamResponse:
        return await self._logged(self._stream)

    async def _stream(self) -> web.StreamResponse:
        try:
            while True:
                rep = await self._next(charge=self.client is None)
                if isinstance(rep, web.StreamResponse):
                    if self.client is None:
                        return rep
                    await self.end_with_error(self.last.reason if self.last else "no replica")
                    return self.client
                result = await self._stream_attempt(rep)
                if result is None:
                    return self.client  # type: ignore[return-value]
                if isinstance(result, web.StreamResponse):
                    return result
                self.last = result
                if self.client is None:
                    continue
                if not await self.prepare_resume():
                    return self.client
        except ClientGone:
            self.gone = True
            return self.client  # type: ignore[return-value]

    async def _stream_attempt(self, rep: Replica) -> Failure | web.StreamResponse | None:
        ctx = self.ctx
        att = ctx.begin(rep, self.tokens, stream=True, prompt_tokens=self.prompt_tokens)
        ctx.owners[self.rkey] = rep.replica_id
        self.ledger.owner = rep.replica_id
        outcome = "error"
        buf = bytearray()
        try:
            async with asyncio.timeout(None) as tm:
                att.arm(tm, ctx.cfg.upstream_timeout)  # the first byte may wait in a queue
                async with ctx.upstream.post(ctx.upstream_url(rep, self.request.path),
                                             self.payload, self._headers()) as up:
                    self._observe(rep, up, att)
                    if up.status != 200:
                        result = await self._status(up)
                        if isinstance(result, web.Response) and self.client is None:
                            outcome = "client_error"
                            return result
                        outcome = "rejected" if up.status == 503 else "error"
                        return result if isinstance(result, Failure) else Failure(
                            f"a replica answered {up.status} to a resumed stream")
                    async for chunk in up.iter_any():
                        att.last_byte = ctx.clock()
                        ctx.progress(att, att.last_byte)
                        att.extend(ctx.cfg.stream_idle_timeout)
                        buf += chunk
                        taken = self.ledger.take(buf, self.rkey in ctx.cancelled)
                        if taken.out or taken.done:
                            await self.write(self.route.stream(taken.out),
                                             eof=taken.done)
                        if taken.failure is not None:
                            return Failure(taken.failure)
                        if taken.done:
                            outcome = "resumed" if self.ledger.resumed else "ok"
                            return None
                    if self.client is not None and self.ledger.complete:
                        await self.write(DONE, eof=True)  # finished but [DONE] was lost
                        outcome = "ok"
                        return None
                    return Failure(f"replica {rep.replica_id} closed the stream early",
                                   lost=True)
        except (asyncio.CancelledError, ClientGone):
            outcome = "cancelled"
            raise
        except (TimeoutError, UpstreamError, OSError) as exc:
            return self._failed(rep, att, exc)
        finally:
            self._end(rep, att, outcome)

    async def write(self, data: bytes, eof: bool = False) -> None:
        """To the client; commits the stream on the first write. ClientGone if it left."""
        if data and (reason := finish_reason_in(data)) is not None:
            self.finish_reason = reason
        try:
            if self.client is None:
                self.client = web.StreamResponse(headers={
                    **SSE_HEADERS, "X-Request-Id": self.rid, "X-Attempt": str(self.attempts)})
                await self.client.prepare(self.request)
            if data:
                await self.client.write(data)
            if eof:
                await self.client.write_eof()
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from None

    async def prepare_resume(self) -> bool:
        """After a failure mid-stream: set up the resumed request and return True, or end the
        stream (explicit error, or the final chunk when nothing was left to generate) and return
        False."""
        reason = self.last.reason if self.last is not None else "the replica failed"
        if not self.ledger.resumable(self.body):
            await self.end_with_error(reason)
            return False
        self.ctx.metrics.failovers.labels("resume").inc()
        nxt = self.ledger.resume(self.body, self.ctx.cfg.policy.default_max_tokens, self.rid)
        if isinstance(nxt, bytes):
            await self.write(nxt, eof=True)
            return False
        self.payload = orjson.dumps(nxt)
        return True

    async def end_with_error(self, reason: str) -> None:
        self.ctx.metrics.failovers.labels("error").inc()
        await self.write(self.ledger.broken(reason), eof=True)
