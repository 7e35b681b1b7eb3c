"""The batch executor: one background task that starts lines while there is spare capacity,
records each answer in the store the moment it arrives, and ends batches (completed, cancelled or
expired) by writing their output and error files (`output_files.py`).

Resuming is reading the store: at start every unfinished batch is loaded with the lines still
pending (including any that were running when the process died), so no answered line runs again
and every unanswered one does. Lines refused for now (tenant budget, queue, SLO) wait their
`retry_after` and run again; the tenant's other lines wait with them.

Each pending line is held as its index and its cost (prompt and output tokens, counted once when
the batch was created): the capacity check reads no line. A line is read from the store (and
parsed, in a worker thread when large) only when it starts. Tenants take turns: each pass offers
the next line of every tenant in turn (a tenant's own batches oldest first), and a line too big
for the room there is now passes its tenant's turn to the others instead of stopping them all.

Housekeeping deletes files past their expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from batcher.batch.lines import Deferred, LineResult, output_line
from batcher.batch.metrics import BatchMetrics
from batcher.batch.output_files import write_outputs
from batcher.batch.records import BatchRecord, PendingLine, new_id
from batcher.batch.store import BatchStore
from batcher.http.errors import error_body
from batcher.admission.tenants import TenantConfig

log = logging.getLogger(__name__)

# Re-check expiry, retries and capacity at least this often; steps and new batches wake it sooner.
TICK_S = 0.05
# A decoding line this close to its end finishes rather than gives way: cancelled, it would be
# run again from the start, and it holds the interactive request back only that many steps.
FINISH_STEPS = 2
# Expired files are looked for this often, also while no batch runs.
HOUSEKEEP_S = 1.0
# A line body longer than this is parsed in a worker thread when its line starts.
PARSE_INLINE_BYTES = 64 * 1024
# Gate refusals that depend on the line's own size: a smaller line of another tenant may still
# fit, so only this tenant's turn passes. Any other refusal holds every line back.
LINE_SIZED = frozenset({"kv", "ttft"})
# Refusals about the server's state (queue, SLO, drain), not a tenant's budget.
SERVER_REFUSALS = frozenset({"queue_full", "queue_slo", "tpot_slo", "draining", "overloaded",
                             "embedding queue full", "shutting down", "engine_error"})


class Runner(Protocol):
    async def run(self, tenant: TenantConfig, url: str, body: dict, request_id: str
                  ) -> LineResult: ...

    def in_prefill(self, request_id: str) -> bool: ...

    def steps_left(self, request_id: str) -> int | None: ...


class Gate(Protocol):
    last_reason: str
    last_code: str
    last_predicted_s: float | None

    def interactive_waiting(self) -> bool: ...

    def shed(self) -> bool: ...

    def room(self, in_flight: int, prompt_tokens: int, max_tokens: int, lines: int = 1
             ) -> bool: ...


@dataclass(slots=True)
class _Batch:
    """An unfinished batch the executor works on."""

    id: str
    tenant: str
    endpoint: str
    expires_at: float
    pending: deque[int]
    cost: dict[int, tuple[int, int]]  # index -> (prompt, max output) tokens, of unanswered lines
    retry: list[tuple[float, int]] = field(default_factory=list)  # heap of (not before, index)
    running: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    request_ids: dict[int, str] = field(default_factory=dict)  # of the running lines
    yielded: set[int] = field(default_factory=set)  # cancelled to make way; run again
    ending: str | None = None  # "cancelled" | "expired" once decided

    @classmethod
    def of(cls, rec: BatchRecord, pending: list[tuple[int, int, int]]) -> _Batch:
        return cls(rec.id, rec.tenant, rec.endpoint, rec.expires_at,
                   deque(i for i, _, _ in pending), {i: (p, o) for i, p, o in pending})

    @property
    def queued(self) -> int:
        return len(self.pending) + len(self.retry)


class BatchExecutor:
    """Runs every unfinished batch in `store` through `runner`, while `gate` allows."""

    def __init__(self, store: BatchStore, runner: Runner, gate: Gate,
                 tenants: Callable[[str], TenantConfig | None], metrics: BatchMetrics,
                 wall_clock: Callable[[], float] = time.time, tick_s: float = TICK_S,
                 file_expiry_s: float | None = None):
        self.store = store
        self.runner = runner
        self.gate = gate
        self.tenants = tenants
        self.metrics = metrics
        self.wall_clock = wall_clock
        self.tick_s = tick_s
        self.file_expiry_s = file_expiry_s  # of output files; None: kept until deleted
        self.batches: dict[str, _Batch] = {}
        # Tenants in turn order: a pass offers a line of each in this order, and a tenant whose
        # line started moves to the back.
        self._turns: dict[str, None] = {}
        self._housekept = 0.0
        self._paused: dict[str, float] = {}  # tenant -> monotonic time its lines may retry
        self._hold_until = 0.0  # no line starts before (admission refused one for now)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        for rec in self.store.active_batches():
            if rec.status == "cancelling":
                self._add(rec, []).ending = "cancelled"
            else:
                self._add(rec, self.store.pending_lines(rec.id))
        if self.batches:
            log.info("resuming %d batches (%d lines pending)", len(self.batches),
                     sum(b.queued for b in self.batches.values()))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-executor")

    async def stop(self) -> None:
        """Stop starting lines and end the running ones; their lines stay pending in the store
        and run again after a restart."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        tasks = [t for b in self.batches.values() for t in b.running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def wake(self, *_: object) -> None:
        """An engine step ended: capacity may have freed. Nothing to do without a batch (a new
        one wakes the loop itself), so an idle tier costs the engine's steps nothing."""
        if self.batches:
            self._wake.set()

    # commands from the routes --------------------------------------------------------------
    def add(self, rec: BatchRecord) -> None:
        """A batch was just created in the store: start working on it."""
        self._add(rec, self.store.pending_lines(rec.id))
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """The store already says `cancelling`: stop its lines and end it."""
        b = self.batches.get(batch_id)
        if b is not None and b.ending is None:
            b.ending = "cancelled"
            self._wake.set()

    @property
    def in_flight(self) -> int:
        return sum(len(b.running) for b in self.batches.values())

    def _add(self, rec: BatchRecord, pending: list[tuple[int, int, int]]) -> _Batch:
        b = self.batches[rec.id] = _Batch.of(rec, pending)
        return b

    # the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                # With no batch, only housekeeping until woken: a new batch, or a step.
                async with asyncio.timeout(self.tick_s if self.batches else HOUSEKEEP_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self._housekeep()
                await self._end_batches()
                self._make_way()
                self._start_lines()
            except Exception:  # a bug here must not end the tier silently; retry next tick
                log.exception("batch executor step failed")
                await asyncio.sleep(1.0)
            self.metrics.queued.set(sum(b.queued for b in self.batches.values()))
            self.metrics.running.set(self.in_flight)

    def _housekeep(self) -> None:
        mono = time.monotonic()
        if mono - self._housekept < HOUSEKEEP_S:
            return
        self._housekept = mono
        if gone := self.store.delete_expired_files():
            log.info("deleted %d expired files", gone)

    async def _end_batches(self) -> None:
        now = self.wall_clock()
        for b in list(self.batches.values()):
            if b.ending is None and now >= b.expires_at:
                b.ending = "expired"
            if b.ending is not None:
                for t in b.running.values():
                    t.cancel()
                if b.running:
                    continue  # their cancellation lands within a step; end the batch then
                await self._finalize(b, b.ending)
            elif not b.queued and not b.running:
                self.store.set_status(b.id, "finalizing", ("in_progress",))
                await self._finalize(b, "completed")

    def _make_way(self) -> None:
        """Batch work gives way to interactive work. An interactive request is queued or
        prefilling: cancel the lines still in prefill (their prompts would be computed first)
        and the decoding ones with more than `FINISH_STEPS` to go (the scheduler cuts prefill
        chunks to keep their time per token, the interactive prompt's too). Interactive
        requests are predicted past `shed_share` of their SLO: cancel the newest running line,
        one per pass (a pass follows every step), until the prediction recovers or one line is
        left. Cancelled lines go back to the head of their batch and run again later (their
        prompts mostly from the prefix cache)."""
        if self.gate.interactive_waiting():
            for b in self.batches.values():
                for index, task in b.running.items():
                    rid = b.request_ids[index]
                    if index not in b.yielded and (
                            self.runner.in_prefill(rid)
                            or (self.runner.steps_left(rid) or 0) > FINISH_STEPS):
                        self._give_way(b, index, task, "yield")
        # NOTE: the oldest line is never shed. One line on an otherwise idle engine may always
        # start (the gate's rule); shedding it would restart it at once, and a line forever in
        # prefill keeps admission from seeing an idle server and refreshing its prediction.
        if self.in_flight > 1 and self.gate.shed():
            for b in reversed(list(self.batches.values())):
                live = [(i, t) for i, t in b.running.items() if i not in b.yielded]
                if live:
                    self._give_way(b, *live[-1], "shed")
                    return

    def _give_way(self, b: _Batch, index: int, task: asyncio.Task[None], why: str) -> None:
        b.yielded.add(index)
        task.cancel()
        self.metrics.deferrals.labels(why).inc()

    def _start_lines(self) -> None:
        mono = time.monotonic()
        if mono < self._hold_until:
            return
        waiting: dict[str, list[_Batch]] = {}  # tenant -> its batches with lines, oldest first
        for b in self.batches.values():
            if b.ending is None and b.queued and self._paused.get(b.tenant, 0.0) <= mono:
                waiting.setdefault(b.tenant, []).append(b)
        have = {b.tenant for b in self.batches.values()}
        self._turns = {t: None for t in self._turns if t in have}
        self._turns.update(dict.fromkeys(waiting))  # a new tenant joins at the back
        order = [t for t in self._turns if t in waiting]
        in_flight = self.in_flight
        # Lines started in this pass are not in the engine's queues yet: the gate must count
        # them with the next one, or one pass could start a burst that no single check allowed.
        started = started_prompt = started_out = 0
        while order:
            for tenant in list(order):
                pick = self._next_line(waiting[tenant], mono)
                if pick is None:
                    order.remove(tenant)
                    continue
                b, index, from_retry = pick
                prompt, out = b.cost.get(index, (1, 1))
                room = self.gate.room(in_flight, started_prompt + prompt, started_out + out,
                                      started + 1)
                if self.gate.last_predicted_s is not None:
                    self.metrics.gate_predicted.set(self.gate.last_predicted_s)
                if not room:
                    self.metrics.gate_blocked.labels(self.gate.last_code).inc()
                    if self.gate.last_code in LINE_SIZED:
                        order.remove(tenant)  # this line waits; other tenants' may fit
                        continue
                    return
                self._take(b, from_retry)
                rid = new_id("batch_req_")
                b.request_ids[index] = rid
                b.running[index] = asyncio.get_running_loop().create_task(
                    self._line(b, index, rid), name=f"batch-line-{b.id}-{index}")
                in_flight += 1
                started += 1
                started_prompt += prompt
                started_out += out
                del self._turns[tenant]
                self._turns[tenant] = None

    @staticmethod
    def _next_line(batches: list[_Batch], mono: float) -> tuple[_Batch, int, bool] | None:
        """(batch, line index, from the retry heap) of the tenant's next line to start."""
        for b in batches:
            if b.retry and b.retry[0][0] <= mono:
                return b, b.retry[0][1], True
            if b.pending:
                return b, b.pending[0], False
        return None

    @staticmethod
    def _take(b: _Batch, from_retry: bool) -> None:
        if from_retry:
            heapq.heappop(b.retry)
        else:
            b.pending.popleft()

    async def _read(self, b: _Batch, index: int) -> PendingLine | None:
        row = self.store.line_bytes(b.id, index)
        if row is None:  # cannot happen while the batch is active
            return None
        custom_id, raw = row
        body = (orjson.loads(raw) if len(raw) <= PARSE_INLINE_BYTES
                else await asyncio.to_thread(orjson.loads, raw))
        return PendingLine(b.id, index, custom_id, body)

    async def _line(self, b: _Batch, index: int, rid: str) -> None:
        try:
            line = await self._read(b, index)
            if line is None:
                return
            tenant = self.tenants(b.tenant)
            if tenant is None:
                result = LineResult(401, error_body(401, "the batch's tenant is no longer "
                                                    "configured", code="invalid_api_key"))
            else:
                try:
                    result = await self.runner.run(tenant, b.endpoint, line.body, rid)
                except Deferred as d:
                    self.metrics.deferrals.labels(d.reason).inc()
                    until = time.monotonic() + d.retry_after
                    heapq.heappush(b.retry, (until, line.index))
                    # The next line would be refused for the same reason: the tenant's budget
                    # holds its other lines back; the server's queue or SLO holds back all.
                    if d.reason in SERVER_REFUSALS:
                        self._hold_until = max(self._hold_until, until)
                    elif d.reason.startswith("tenant_"):
                        self._paused[b.tenant] = max(self._paused.get(b.tenant, 0.0), until)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.exception("batch line failed")
                    result = LineResult(500, error_body(500, f"internal error: {exc}",
                                                        code="internal_error"))
            if self.store.record_result(b.id, line.index, result.status_code,
                                        output_line(line.custom_id, result), result.tokens):
                b.cost.pop(index, None)
                self.metrics.done.labels("ok" if result.ok else "error").inc()
                if result.ok:
                    self.metrics.tokens.inc(result.tokens)
        finally:
            b.running.pop(index, None)
            b.request_ids.pop(index, None)
            if index in b.yielded:
                b.yielded.discard(index)
                if b.ending is None:
                    b.pending.appendleft(index)
            self._wake.set()

    # ending a batch ------------------------------------------------------------------------
    async def _finalize(self, b: _Batch, status: str) -> None:
        """Write the batch's output and error files, mark it `status` (`output_files.py`) and
        stop working on it."""
        await write_outputs(self.store, self.metrics, b.id, b.tenant, status, self.file_expiry_s)
        del self.batches[b.id]
        log.info("batch %s %s", b.id, status)
