"""What the global balancer adds to a request, against the cell's router called directly.

`batcher fleet --cells 2 --replicas 1 --model fake`, the same small completion sent one at a time
straight to a cell's router and through the balancer, interleaved (so the machine's other load
hits both alike). Prints a table and appends it to BENCHMARKS.md.

    python -m scripts.bench balancer [--requests 300] [--no-append]
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import aiohttp

from batcher.bench.common import append_rows, pct
from batcher.fleet.launcher import free_port
from scripts.bench._shared import ROOT, parser


async def measure(port: int, admin: int, n: int) -> tuple[list[float], list[float]]:
    headers = {"Authorization": "Bearer bench"}
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 180
        st: dict = {}
        while time.monotonic() < deadline:
            try:
                async with s.get(f"http://127.0.0.1:{admin}/admin/status", headers=headers) as r:
                    st = await r.json()
                if sum(c["routable"] for c in st["replicas"]) == 2:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
        else:
            raise TimeoutError(f"cells not routable: {st}")
        cell, top = st["replicas"][0]["url"], f"http://127.0.0.1:{port}"
        body = {"model": "fake", "prompt": "hello world", "max_tokens": 4, "temperature": 0}

        async def once(url: str) -> float:
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status}")
            return time.perf_counter() - t

        direct, through = [], []
        for _ in range(n):
            direct.append(await once(cell))
            through.append(await once(top))
        return direct, through


def main(argv: list[str]) -> int:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    port, admin = free_port(), free_port()
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batcher.app.cli", "fleet", "--cells", "2", "--replicas", "1",
         "--model", "fake", "--embedding-model", "none", "--fake-decode-step-ms", "5",
         "--port", str(port), "--admin-port", str(admin), "--admin-key", "bench",
         "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        direct, through = asyncio.run(measure(port, admin, args.requests))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    md, mb = statistics.median(direct), statistics.median(through)
    rows = [[name, f"{statistics.median(v) * 1e3:.1f}", f"{pct(v, 90) * 1e3:.1f}",
             f"{pct(v, 99) * 1e3:.1f}"] for name, v in (("cell router directly", direct),
                                                     ("through the balancer", through))]
    notes = (f"- {args.requests} requests each, one at a time, interleaved; 4 tokens of the "
             f"fake model (5 ms steps). The balancer adds {(mb - md) * 1e3:.1f} ms at the "
             f"median (ratio {mb / md:.3f}).\n- Machine shared with other work: load average "
             f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after.\n")
    header = ["path", "p50 ms", "p90 ms", "p99 ms"]
    if args.no_append:
        print("| " + " | ".join(header) + " |")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(notes)
    else:
        print(append_rows("Balancer overhead: straight to a cell vs through the balancer",
                          header, rows, notes))
    return 0

