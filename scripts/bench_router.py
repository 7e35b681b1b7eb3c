"""Router overhead: the latency a router adds to a request, measured against a direct call to the
same fake replica, alternating the two so drift hits both alike. Appends rows to BENCHMARKS.md.

    python scripts/bench_router.py [--requests 400] [--no-append]

Target: the router adds <= 1 ms at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, append_rows, pct


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a process exited early (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


async def timed(s: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> float:
    """Seconds to the whole answer, or to the first event of a stream."""
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", data=body) as resp:
        if stream:
            await resp.content.readuntil(b"\n\n")
            elapsed = time.perf_counter() - t0
            await resp.read()
            return elapsed
        await resp.read()
        assert resp.status == 200, resp.status
    return time.perf_counter() - t0


async def measure(direct: str, routed: str, n: int, stream: bool) -> tuple[list[float], ...]:
    body = orjson.dumps({"model": "fake", "prompt": "benchmark the router", "max_tokens": 1,
                         "temperature": 0, "stream": stream})
    a: list[float] = []
    b: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(20):  # warm both paths (connections, caches)
            await timed(s, direct, body, stream)
            await timed(s, routed, body, stream)
        for i in range(n):
            first, second = (direct, routed) if i % 2 else (routed, direct)
            t1 = await timed(s, first, body, stream)
            t2 = await timed(s, second, body, stream)
            a.append(t1 if first == direct else t2)
            b.append(t2 if first == direct else t1)
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="pairs per mode")
    ap.add_argument("--no-append", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = ap.parse_args()
    rport, xport = free_port(), free_port()
    rep = start(["-m", "batcher.cli", "serve", "--model", "fake", "--embedding-model", "none",
                 "--port", str(rport), "--fake-decode-step-ms", "1", "--log-level", "warning"])
    direct, routed = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{xport}"
    router = start(["-m", "batcher.fleet.cli", "router", "--port", str(xport), "--replica",
                    direct, "--log-level", "warning"])
    try:
        wait_up(direct + "/ready", rep)
        wait_up(routed + "/ready", router)
        rows = []
        for stream in (False, True):
            d, r = asyncio.run(measure(direct, routed, args.requests, stream))
            added = [(y - x) * 1000 for x, y in zip(d, r)]
            mode = "stream, first event" if stream else "whole answer"
            rows.append([mode, "1 fake replica, max_tokens 1", str(args.requests),
                         f"{pct(d, 50) * 1000:.2f}", f"{pct(r, 50) * 1000:.2f}",
                         f"{pct(added, 50):.2f}", f"{pct(added, 99):.2f}",
                         "yes" if pct(added, 50) <= 1.0 else "no"])
    finally:
        for p in (router, rep):
            p.terminate()
            p.wait(timeout=30)
    header = ["mode", "setup", "pairs", "direct p50 ms", "routed p50 ms", "added p50 ms",
              "added p99 ms", "<= 1 ms"]
    notes = ("Sequential requests on loopback, direct and routed calls alternated; 'added' is "
             "the per-pair difference.")
    if args.no_append:
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))
    else:
        print(append_rows(f"Router overhead (scripts/bench_router.py), {os.cpu_count()} CPUs",
                          header, rows, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
