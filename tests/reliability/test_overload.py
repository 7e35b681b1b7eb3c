"""Overload: offered load at 3x measured capacity for 30 s against one server.

Pass figures: admitted requests keep p99 TTFT within the SLO; every other request is
answered 429/503 with Retry-After, p99 within 50 ms; the server's RSS ends within 10% of where it
started (after a warm-up); goodput (requests finished with TTFT within the SLO, per second) stays at
least 90% of the goodput at 1x.

The fake model (fixed 25 ms decode step, 8 sequences at once, 16 tokens per request) makes capacity
known and stable: about 8 / (16 x 27 ms) = 18 requests/s, measured below before the load runs.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.reliability.conftest import (
    FAKE,
    Outcome,
    metric_value,
    open_loop,
    percentile,
    rss_bytes,
    stream_request,
)
from tests.server_process import serve, wait_idle

SLO_TTFT_S = 1.0
MAX_SEQS = 8
MAX_TOKENS = 16
OVERLOAD_S = 30.0
BASELINE_S = 8.0
FLAGS = (*FAKE, "--fake-decode-step-ms", "25", "--max-num-seqs", str(MAX_SEQS),
         "--max-waiting", str(MAX_SEQS), "--slo-ttft-ms", str(int(SLO_TTFT_S * 1000)),
         "--num-blocks", "512")


def body(i: int) -> dict[str, object]:
    return {"model": "fake", "prompt": f"request {i}: tell me about the sea", "max_tokens":
            MAX_TOKENS, "ignore_eos": True}


async def measure_capacity(session: aiohttp.ClientSession, url: str, seconds: float = 4.0
                           ) -> float:
    """Completed requests per second with the batch kept full (a closed loop of 1.5x the slots,
    so a finished request's slot is refilled at the next step)."""
    stop = time.monotonic() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < stop:
            out = await stream_request(session, url, body(w * 1000 + i))
            i += 1
            if out.status == 503:  # the few extra clients keep the batch full; a full queue
                await asyncio.sleep(0.01)  # answers them at once
                continue
            assert out.ok, out
            done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(MAX_SEQS * 3 // 2)))
    return done / (time.monotonic() - start)


def goodput(outcomes: list[Outcome], seconds: float) -> float:
    return sum(o.ok and o.ttft_s <= SLO_TTFT_S for o in outcomes) / seconds


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("frozen_gc")
async def test_overload_3x_capacity() -> None:
    with serve(*FLAGS) as server:
        url = server.url
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            capacity = await measure_capacity(session, url)
            assert capacity > 5, f"capacity {capacity:.1f} req/s: the machine is too slow"
            await wait_idle(session, url, within=5)

            async def send(i: int) -> Outcome:
                return await stream_request(session, url, body(i))

            base, base_rate = await open_loop(capacity, BASELINE_S, send)
            await wait_idle(session, url, within=5)
            rss_start = rss_bytes(server.proc.pid)  # after warm-up: capacity run and 1x load

            over, over_rate = await open_loop(3 * capacity, OVERLOAD_S, send)
            await wait_idle(session, url, within=5)
            await asyncio.sleep(0.5)
            rss_end = rss_bytes(server.proc.pid)
            server_goodput = await metric_value(session, url, "batcher_goodput_requests_total")

    admitted = [o for o in over if o.status == 200]
    rejected = [o for o in over if o.status != 200]
    ttft_p99 = percentile([o.ttft_s for o in admitted], 99)
    reject_p99 = percentile([o.headers_s for o in rejected], 99)
    g1, g3 = goodput(base, BASELINE_S), goodput(over, OVERLOAD_S)
    figures = (f"capacity {capacity:.1f} req/s; offered 1x {base_rate:.1f}, 3x {over_rate:.1f}"
               f" req/s; 3x: {len(admitted)} admitted, {len(rejected)} rejected; admitted TTFT "
               f"p99 {ttft_p99 * 1000:.0f} ms; rejection p99 {reject_p99 * 1000:.1f} ms; goodput"
               f" 1x {g1:.2f}/s, 3x {g3:.2f}/s ({g3 / g1:.0%}); RSS {rss_start / 2**20:.1f} -> "
               f"{rss_end / 2**20:.1f} MiB; server goodput counter {server_goodput:.0f}")
    print(figures)
    assert over_rate >= 2.7 * capacity, f"the client could not offer 3x: {figures}"
    assert all(o.ok for o in admitted), [o for o in admitted if not o.ok][:3]
    assert all(o.status in (429, 503) for o in rejected), {o.status for o in rejected}
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in rejected)
    assert len(rejected) > len(over) / 3, f"3x load was mostly admitted: {figures}"
    assert ttft_p99 <= SLO_TTFT_S, figures
    assert reject_p99 <= 0.050, figures
    assert rss_end <= 1.10 * rss_start, figures
    assert g3 >= 0.9 * g1, figures
