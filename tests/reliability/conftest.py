"""Shared pieces of the reliability suite: process figures from /proc, percentiles, one streaming
request measured from the client's side, and a bounded open-loop load generator.

Every server here is a real `batcher serve` subprocess on 127.0.0.1 (see tests/server_process.py),
started and stopped by the test or module that uses it. Load loops are bounded both in count and
in time.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tests.server_process import DONE

# The fake model: the real scheduler and block pool, a simulated step (fixed decode step time), so
# capacity is known and stable even on a loaded 2-core machine.
FAKE = ("--model", "fake", "--log-level", "warning")


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(slots=True)
class Outcome:
    """What one client saw. `status` 0: no HTTP answer (a connection error or client timeout)."""

    status: int = 0
    headers_s: float = math.nan  # send -> response headers (the time a rejection takes)
    ttft_s: float = math.nan  # send -> first generated text
    total_s: float = math.nan
    retry_after: str | None = None
    done: bool = False  # a stream that ended with [DONE] and a finish_reason, no error event
    error: str | None = None
    tokens: int = 0
    tag: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None, tag: str = "",
                         timeout: float = 30.0) -> Outcome:
    """POST a streaming completion and read it to the end, timing the answer as a client does."""
    out = Outcome(tag=tag)
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/completions", json=dict(body, stream=True),
                                    headers=headers) as resp:
                out.headers_s = time.monotonic() - start
                out.status = resp.status
                out.retry_after = resp.headers.get("Retry-After")
                if resp.status != 200:
                    out.error = (await resp.read()).decode(errors="replace")[:300]
                    return out
                finished = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == DONE.encode():
                        out.done = finished and out.error is None
                        break
                    event = orjson.loads(data)
                    if "error" in event:
                        out.error = str(event["error"].get("message"))
                        continue
                    choice = event["choices"][0]
                    if choice.get("text") and math.isnan(out.ttft_s):
                        out.ttft_s = time.monotonic() - start
                    out.tokens += 1 if choice.get("text") else 0
                    finished = finished or choice.get("finish_reason") is not None
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.total_s = time.monotonic() - start
    return out


async def open_loop(rate: float, duration: float, send: Callable[[int], Awaitable[Outcome]],
                    max_requests: int | None = None, drain_timeout: float = 30.0
                    ) -> tuple[list[Outcome], float]:
    """Start `send(i)` at `rate` per second for `duration` seconds (evenly spaced, whatever the
    answers: an open loop), then wait for all of them. Returns the outcomes and the rate actually
    offered. Bounded: at most `max_requests` (default rate x duration) and `drain_timeout`."""
    count = min(max_requests or 1 << 30, max(1, round(rate * duration)))
    tasks: list[asyncio.Task[Outcome]] = []
    start = time.monotonic()
    for i in range(count):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
    offered = count / max(1e-9, time.monotonic() - start + 1 / rate)
    _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert not pending, (f"{len(pending)} requests still unanswered {drain_timeout:g}s after "
                         "the load")
    return [t.result() for t in tasks], offered


async def metric_value(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """Sum of a Prometheus series `name` (all label sets) from /metrics."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
