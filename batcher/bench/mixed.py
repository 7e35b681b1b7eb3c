"""A mixed run: interactive Poisson traffic with and without a batch on spare capacity.

Phases, one server, one run (each bounded in time and count):

1. capacity: a closed loop of `capacity_users` interactive requests for `capacity_s` seconds;
   the completed requests per second are the server's interactive capacity right now (on a
   shared machine, capacity is what is left by everything else).
2. interactive alone: Poisson arrivals at `rate_share` of that capacity for `alone_s` seconds.
3. interactive + batch: the same arrivals while a batch of `lines` short requests runs through
   `/v1/files` and `/v1/batches`, until the batch ends (or `max_s`: then it is cancelled).
4. interactive + live batch (contrast, `contrast_s` > 0): the same arrivals while `live_users`
   clients send the batch's lines as live `priority: batch` requests (what a batch client does
   without the batch API: admission and the scheduler's priority, but no spare-capacity gate).
5. interactive alone again: how far the shared machine drifted during the run.

Interactive TTFT is measured by the client (first streamed text). The batch phases also report
the server's spare-capacity counters (`batcher_batch_*`).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from batcher.bench.client import ClientConfig, RequestResult, send_request
from batcher.bench.common import pct
from batcher.bench.load import CpuMeter, CpuUse
from batcher.bench.workload import BenchRequest, synthetic

TERMINAL = ("completed", "failed", "expired", "cancelled")
HEADER = ["phase", "interactive /s", "sent", "ok", "refused", "TTFT p50 ms", "TTFT p99 ms",
          "within SLO", "batch work", "CPU cores (server / other)"]


@dataclass(slots=True)
class MixedConfig:
    """Shapes and bounds of a mixed run; `rate` (requests/s) skips the capacity phase."""

    slo_ttft_s: float = 2.0
    lines: int = 1000
    line_prompt_tokens: int = 50
    line_max_tokens: int = 16
    prompt_tokens: int = 100
    max_tokens: int = 32
    rate: float | None = None
    rate_share: float = 0.45
    capacity_s: float = 30.0
    capacity_users: int = 8
    alone_s: float = 40.0
    max_s: float = 600.0
    contrast_s: float = 60.0
    live_users: int = 16
    server_pid: int | None = None
    seed: int = 1
    gate_share: float = 0.5  # the server's --batch-ttft-share, for the report
    # An alone phase runs on until about this many requests were sent (at most 3x alone_s):
    # at a low rate, alone_s alone would leave too few for a p99.
    alone_min_requests: int = 12

    def alone_duration(self, rate: float) -> float:
        return min(3 * self.alone_s, max(self.alone_s, self.alone_min_requests / rate))

    def validate(self) -> MixedConfig:
        if self.lines < 1 or self.line_max_tokens < 1 or self.max_tokens < 1:
            raise ValueError("a mixed run needs >= 1 batch line and >= 1 token per answer")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("the interactive rate must be > 0")
        if not 0 < self.rate_share <= 1:
            raise ValueError("the share of capacity must be in (0, 1]")
        if min(self.capacity_s, self.alone_s, self.max_s) <= 0 or self.contrast_s < 0:
            raise ValueError("phase durations must be > 0 (the contrast phase may be 0: off)")
        if self.capacity_users < 1 or self.live_users < 1:
            raise ValueError("closed loops need at least one user")
        return self


@dataclass(slots=True)
class Phase:
    name: str
    rate: float
    results: list[RequestResult]
    cpu: CpuUse | None
    batch: str = ""  # what the batch work did, for the table

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.results if r.ok and r.ttft is not None]

    def p99(self) -> float:
        return pct(self.ttfts(), 99)


@dataclass(slots=True)
class MixedReport:
    capacity_rps: float | None
    rate: float
    phases: list[Phase] = field(default_factory=list)
    batch_status: str = ""
    batch_done: int = 0
    batch_wall_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)  # batcher_batch_* deltas, phase 3
    max_lines_running: float = 0.0
    gate_predicted: list[float] = field(default_factory=list)  # polled, seconds

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)


def _requests(n: int, prompt: int, out: int, seed: int, prefix: str) -> list[BenchRequest]:
    reqs = synthetic(n, input_median=prompt, input_spread=0.0, output_median=out,
                     output_spread=0.0, seed=seed, min_input=prompt, max_input=prompt,
                     min_output=out, max_output=out)
    return [BenchRequest(f"{prefix}-{i}", r.prompt_ids, r.prompt_text, out)
            for i, r in enumerate(reqs)]


def batch_lines(mc: MixedConfig, model: str) -> list[dict[str, Any]]:
    """The batch input: `lines` completions of `line_prompt_tokens` tokens (token ids, so the
    length is exact), `line_max_tokens` out."""
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens,
                      "ignore_eos": True, "temperature": 0}}
            for i, r in enumerate(_requests(mc.lines, mc.line_prompt_tokens, mc.line_max_tokens,
                                            mc.seed + 7, "line"))]


def _auth(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def _poisson(session: aiohttp.ClientSession, cfg: ClientConfig, mc: MixedConfig,
                   rate: float, seed: int, duration: float, stop: asyncio.Event | None = None
                   ) -> list[RequestResult]:
    """Open-loop interactive arrivals for `duration` s (or until `stop`), at most 3x the
    expected count."""
    import random

    rng = random.Random(seed)
    reqs = _requests(max(1, int(3 * rate * duration) + 1), mc.prompt_tokens, mc.max_tokens,
                     seed, f"live{seed}")
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    at = rng.expovariate(rate)
    while at < duration and len(tasks) < len(reqs) and not (stop and stop.is_set()):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    break
                except TimeoutError:
                    pass
        tasks.append(asyncio.create_task(send_request(session, cfg, reqs[len(tasks)], t0)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def _closed(session: aiohttp.ClientSession, cfg: ClientConfig, reqs: list[BenchRequest],
                  users: int, duration: float, stop: asyncio.Event | None = None
                  ) -> list[RequestResult]:
    """`users` clients, each sending its next request when the last ended, for `duration` s or
    until the requests run out; a refusal waits its Retry-After (at most 2 s) and is resent."""
    t0 = time.perf_counter()
    todo = list(reversed(reqs))
    done: list[RequestResult] = []

    async def user() -> None:
        while todo and time.perf_counter() - t0 < duration and not (stop and stop.is_set()):
            req = todo.pop()
            r = await send_request(session, cfg, req, t0)
            done.append(r)
            if r.status in (429, 503):
                todo.append(req)
                await asyncio.sleep(min(2.0, float(r.retry_after or 1)))

    await asyncio.gather(*(user() for _ in range(users)))
    return done


async def batch_metrics(session: aiohttp.ClientSession, cfg: ClientConfig) -> dict[str, float]:
    """The server's `batcher_batch_*` series (empty when it has no batch tier)."""
    try:
        async with session.get(cfg.base_url.rstrip("/") + "/metrics",
                               headers=_auth(cfg)) as r:
            text = await r.text()
    except (aiohttp.ClientError, ConnectionError):
        return {}
    out: dict[str, float] = {}
    for ln in text.splitlines():
        m = re.match(r"(batcher_batch_[a-z_]+?)(_created)?(\{[^}]*\})? ([0-9.e+-]+)$", ln)
        if m and not m.group(2):
            out[m.group(1) + (m.group(3) or "")] = float(m.group(4))
    return out


async def submit_batch(session: aiohttp.ClientSession, cfg: ClientConfig,
                       lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Upload the lines and create the batch; the batch object as the server returns it."""
    base = cfg.base_url.rstrip("/")
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"".join(orjson.dumps(x) + b"\n" for x in lines),
                   filename="mixed.jsonl", content_type="application/jsonl")
    async with session.post(base + "/v1/files", data=form, headers=_auth(cfg)) as r:
        body = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"file upload refused ({r.status}): {body}")
    async with session.post(base + "/v1/batches", headers=_auth(cfg), json={
            "input_file_id": body["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}) as r:
        batch = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"batch creation refused ({r.status}): {batch}")
    return batch


async def _follow_batch(session: aiohttp.ClientSession, cfg: ClientConfig, batch_id: str,
                        max_s: float, done: asyncio.Event, running: list[float],
                        predicted: list[float]) -> tuple[dict[str, Any], float]:
    """Poll until the batch ends or `max_s` passed (then cancel it); sets `done` either way."""
    base = cfg.base_url.rstrip("/")
    t0 = time.perf_counter()
    batch: dict[str, Any] = {}
    try:
        while True:
            async with session.get(f"{base}/v1/batches/{batch_id}", headers=_auth(cfg)) as r:
                batch = await r.json(content_type=None)
            m = await batch_metrics(session, cfg)
            running.append(m.get("batcher_batch_lines_running", 0.0))
            if m.get("batcher_batch_gate_predicted_ttft_seconds"):
                predicted.append(m["batcher_batch_gate_predicted_ttft_seconds"])
            if batch.get("status") in TERMINAL or time.perf_counter() - t0 >= max_s:
                break
            await asyncio.sleep(0.5)
        wall = time.perf_counter() - t0
        if batch.get("status") not in TERMINAL:
            async with session.post(f"{base}/v1/batches/{batch_id}/cancel",
                                    headers=_auth(cfg)) as r:
                await r.read()
        return batch, wall
    finally:
        done.set()


async def measure_capacity(session: aiohttp.ClientSession, cfg: ClientConfig,
                           mc: MixedConfig) -> float:
    """Interactive requests completed per second by a closed loop of `capacity_users`."""
    reqs = _requests(max(8, int(mc.capacity_s * 10)), mc.prompt_tokens, mc.max_tokens,
                     mc.seed + 3, "cap")
    t0 = time.perf_counter()
    results = await _closed(session, cfg, reqs, mc.capacity_users, mc.capacity_s)
    elapsed = time.perf_counter() - t0
    ok = sum(r.ok for r in results)
    if ok == 0:
        raise RuntimeError("no request succeeded while measuring capacity")
    return ok / elapsed


async def _phase(name: str, rate: float, mc: MixedConfig, coro: Any, batch: str = ""
                 ) -> Phase:
    meter = CpuMeter(mc.server_pid)
    meter.start()
    results = await coro
    return Phase(name, rate, results, meter.stop(), batch)


async def run_mixed(session: aiohttp.ClientSession, cfg: ClientConfig, mc: MixedConfig
                    ) -> MixedReport:
    """Every phase in order against one server (see the module docstring)."""
    mc.validate()
    warm = _requests(4, mc.prompt_tokens, 4, mc.seed + 5, "warm")
    for r in warm:
        await send_request(session, cfg, r, time.perf_counter())
    cap = None if mc.rate is not None else await measure_capacity(session, cfg, mc)
    rate = mc.rate if mc.rate is not None else mc.rate_share * (cap or 0.0)
    rep = MixedReport(cap, rate)
    alone_s = mc.alone_duration(rate)
    rep.phases.append(await _phase("interactive alone (before)", rate, mc,
                                   _poisson(session, cfg, mc, rate, 11, alone_s)))
    before = await batch_metrics(session, cfg)
    batch = await submit_batch(session, cfg, batch_lines(mc, cfg.model))
    done = asyncio.Event()
    running: list[float] = []
    follow = asyncio.create_task(_follow_batch(session, cfg, batch["id"], mc.max_s, done,
                                               running, rep.gate_predicted))
    phase = await _phase("interactive + batch (batch API)", rate, mc,
                         _poisson(session, cfg, mc, rate, 12, mc.max_s, done))
    batch, rep.batch_wall_s = await follow
    after = await batch_metrics(session, cfg)
    rep.server = {k: v - before.get(k, 0.0) for k, v in after.items()
                  if not k.endswith(("_queued", "_running", "_seconds"))}
    rep.batch_status = str(batch.get("status"))
    rep.batch_done = int((batch.get("request_counts") or {}).get("completed", 0))
    rep.max_lines_running = max(running, default=0.0)
    phase.batch = (f"{rep.batch_status}: {rep.batch_done}/{mc.lines} lines in "
                   f"{rep.batch_wall_s:.0f} s ({rep.batch_done / rep.batch_wall_s:.2f}/s)")
    rep.phases.append(phase)
    if mc.contrast_s > 0:
        live = ClientConfig(cfg.base_url, cfg.model, "completions", cfg.api_key, True,
                            cfg.temperature, "batch", "ids", cfg.request_timeout)
        lines = _requests(mc.lines, mc.line_prompt_tokens, mc.line_max_tokens, mc.seed + 7,
                          "lineb")
        stop = asyncio.Event()
        t0 = time.perf_counter()

        async def pushed() -> list[RequestResult]:
            try:
                return await _closed(session, live, lines, mc.live_users, mc.contrast_s)
            finally:
                stop.set()

        pusher = asyncio.create_task(pushed())
        phase = await _phase("interactive + live priority:batch", rate, mc,
                             _poisson(session, cfg, mc, rate, 13, mc.contrast_s, stop))
        res = await pusher
        wall = time.perf_counter() - t0
        ok = sum(r.ok for r in res)
        phase.batch = (f"live: {ok}/{mc.lines} lines in {wall:.0f} s ({ok / wall:.2f}/s), "
                       f"{sum(r.status in (429, 503) for r in res)} refusals resent")
        rep.phases.append(phase)
    rep.phases.append(await _phase("interactive alone (after)", rate, mc,
                                   _poisson(session, cfg, mc, rate, 14, alone_s)))
    return rep


def _ms(x: float) -> str:
    return "—" if math.isnan(x) else f"{x * 1000:,.0f}"


def report_rows(rep: MixedReport, mc: MixedConfig) -> tuple[list[list[str]], str, bool]:
    """The table rows, the notes under them, and whether the run met its goal: the batch
    completed through the API with interactive p99 TTFT within the SLO."""
    slo = mc.slo_ttft_s
    rows = []
    for p in rep.phases:
        t = p.ttfts()
        cpu = "" if p.cpu is None else (
            f"{p.cpu.server:.2f} / {p.cpu.machine - p.cpu.server:.2f}"
            if p.cpu.server is not None else f"machine {p.cpu.machine:.2f}")
        rows.append([p.name, f"{p.rate:.2f}", str(len(p.results)),
                     str(sum(r.ok for r in p.results)),
                     str(sum(r.status in (429, 503) for r in p.results)),
                     _ms(pct(t, 50)), _ms(pct(t, 99)),
                     f"{sum(x <= slo for x in t)}/{len(t)}", p.batch, cpu])
    mixed = rep.phase("interactive + batch (batch API)")
    ok = (mixed is not None and rep.batch_status == "completed"
          and not math.isnan(mixed.p99()) and mixed.p99() <= slo)
    s = rep.server
    deferrals = {k.split('"')[1]: int(v) for k, v in s.items() if "deferrals" in k and v}
    blocked = {k.split('"')[1]: int(v) for k, v in s.items() if "gate_blocked" in k and v}
    gp = rep.gate_predicted
    gate = (f"the gate's predicted interactive TTFT right after a new line (polled): median "
            f"{pct(gp, 50):.2f} s, p90 {pct(gp, 90):.2f} s, against its limit of "
            f"{mc.gate_share:g} x SLO = {mc.gate_share * slo:.2f} s" if gp else
            "no gate prediction was polled")
    cap = (f"capacity {rep.capacity_rps:.2f} interactive requests/s (closed loop of "
           f"{mc.capacity_users}, {mc.capacity_s:g} s), driven at {mc.rate_share:g}x = "
           f"{rep.rate:.2f}/s" if rep.capacity_rps is not None else
           f"driven at {rep.rate:.2f}/s (given)")
    notes = "\n".join((
        (f"- Interactive: Poisson, {mc.prompt_tokens}-token prompts, {mc.max_tokens} tokens "
        f"out, streamed, TTFT measured by the client; {cap}. SLO {slo * 1000:g} ms."),
        (f"- Batch: {mc.lines} lines of {mc.line_prompt_tokens}-token prompts, "
        f"{mc.line_max_tokens} tokens out, through /v1/files + /v1/batches; at most "
        f"{rep.max_lines_running:.0f} lines running at once (polled); spare-capacity tokens "
        f"{s.get('batcher_batch_spare_capacity_tokens_total', 0):,.0f}; line starts put off: "
        f"{deferrals or 'none'} (yield: a line in prefill made way for a queued interactive "
        f"request; shed: a running line cancelled while interactive TTFT was predicted past "
        f"its share of the SLO; others: admission's refusals). Executor passes that found no "
        f"room for the next line, by what blocked it: {blocked or 'none'}; {gate}."),
        (f"- Goal (batch completed through the API, interactive p99 TTFT within the SLO): "
        f"{'met' if ok else 'NOT met'}.")))
    return rows, notes, ok
