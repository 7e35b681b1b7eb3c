"""TPOT admission on the bundled model: a burst of long generations, the check on and off.

`batcher serve --slo-tpot-ms N` (all else default) gets a Poisson burst of long generations at far
more streams than N allows. Prints how many were admitted, how many refused for TPOT
(`batcher_requests_rejected_total{reason="tpot_slo"}`), and the admitted streams' time per output
token as the client saw it, with and without the check (`--slo-tpot-ms 0` is the same run with the
check off) side by side in one run.

    python -m scripts.bench tpot_admission --slo-tpot-ms 150

A measurement, not a test: on a shared CPU the step time moves with the neighbours' load.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from scripts.bench._shared import parser
from tests.reliability.conftest import metric_value, percentile
from tests.server_process import serve


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int
                     ) -> tuple[int, float | None]:
    """(status, the stream's mean time per output token as the client saw it)."""
    body = {"model": "smollm2-135m", "prompt": f"Story {i}: once upon a time",
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    async with asyncio.timeout(120):
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return resp.status, None
            times = []
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data:") and b'"text":""' not in line and b"[DONE]" not in line:
                    times.append(time.monotonic())
    return 200, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


async def run(slo_ms: float, rate: float, seconds: float, max_tokens: int) -> str:
    flags = ("--model", "smollm2-135m", "--log-level", "warning", "--slo-tpot-ms", f"{slo_ms:g}")
    with serve(*flags, num_blocks=None, ready_timeout=120) as server:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await one_stream(session, server.url, -1, max_tokens)  # warm-up
            rng = random.Random(5)
            tasks, start = [], time.monotonic()
            while len(tasks) < 4 * rate * seconds:
                await asyncio.sleep(rng.expovariate(rate))
                if time.monotonic() - start > seconds:
                    break
                tasks.append(asyncio.create_task(
                    one_stream(session, server.url, len(tasks), max_tokens)))
            results = await asyncio.gather(*tasks)
            refused_tpot = await metric_value(
                session, server.url, 'batcher_requests_rejected_total{reason="tpot_slo"}')
    tpots = [t for s, t in results if s == 200 and t is not None]
    return (f"--slo-tpot-ms {slo_ms:g}: {len(results)} sent, {len(tpots)} admitted, "
            f"{sum(s != 200 for s, _ in results)} refused ({refused_tpot:.0f} for TPOT); "
            f"admitted TPOT p50 {percentile(tpots, 50) * 1000:.0f} ms, "
            f"p99 {percentile(tpots, 99) * 1000:.0f} ms")


def main(argv: list[str]) -> int:
    p = parser(__name__, __doc__, first_paragraph=True)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)
    for slo in (args.slo_tpot_ms, 0.0):
        print(asyncio.run(run(slo, args.rate, args.seconds, args.max_tokens)), flush=True)
    return 0

