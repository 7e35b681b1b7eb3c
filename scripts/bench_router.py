"""Router overhead: the latency a router adds to a request, measured against a direct call to the
same fake replica, alternating the two so drift hits both alike; and the routing decision alone
(`RouterContext.pick`, in-process) on fleets of 1 to 256 replicas, every candidate scored
against a sample of `--choices`, alternated the same way. Appends rows to BENCHMARKS.md.

    python scripts/bench_router.py [--requests 400] [--decisions 2000] [--no-append]

Target: the router adds <= 1 ms at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

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


def decision_context(replicas: int, choices: int, streams: int = 3) -> Any:
    """A router context whose registry holds `replicas` reporting replicas, each with `streams`
    of the router's own streams in flight (so the load account has something to read)."""
    from batcher.fleet.context import RouterConfig, RouterContext
    from batcher.fleet.policy import PolicyConfig

    now = [100.0]
    ctx = RouterContext(RouterConfig(policy=PolicyConfig(choices=choices)),
                        clock=lambda: now[0], rng=random.Random(0))
    for i in range(replicas):
        rid = f"r{i}"
        ctx.registry.beat({"replica_id": rid, "url": f"http://127.0.0.1:1/{rid}", "epoch": 1,
                           "seq": 1, "free_blocks": 1000, "total_blocks": 1000,
                           "block_size": 16, "running": streams, "waiting": 0,
                           "version": "v1", "draining": False, "healthy": True}, now[0])
    for i, rep in enumerate(ctx.registry):
        for _ in range(streams):
            ctx.begin(rep, 600, stream=True, prompt_tokens=500 + 10 * (i % 7))
    now[0] += 0.5
    return ctx


def decisions(n: int, choices: int) -> list[list[str]]:
    """`pick` timed per call for 1, 32 and 256 replicas, all scored vs `choices` sampled,
    the two alternated call by call."""
    rows = []
    key = "a shared system prompt " * 8
    for replicas in (1, 32, 256):
        ctxs = {"all": decision_context(replicas, 0), "sampled": decision_context(replicas,
                                                                                   choices)}
        times: dict[str, list[float]] = {m: [] for m in ctxs}
        cpu: dict[str, float] = {m: 0.0 for m in ctxs}
        for i in range(n + 50):
            for mode in (("all", "sampled") if i % 2 else ("sampled", "all")):
                c0, t0 = time.process_time(), time.perf_counter()
                ctxs[mode].pick(600, key if i % 4 < 2 else None, set(), 500)
                t1, c1 = time.perf_counter(), time.process_time()
                if i >= 50:  # warm-up calls are not counted
                    times[mode].append((t1 - t0) * 1000)
                    cpu[mode] += c1 - c0
        for mode in ctxs:
            scored = replicas if mode == "all" or replicas <= 64 else choices + 1
            rows.append([str(replicas), mode, f"<= {scored}", str(n),
                         f"{pct(times[mode], 50):.3f}", f"{pct(times[mode], 99):.3f}",
                         f"{cpu[mode] / n * 1000:.3f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="pairs per mode")
    ap.add_argument("--decisions", type=int, default=2000, help="timed picks per fleet size "
                    "and mode (0: skip)")
    ap.add_argument("--choices", type=int, default=8, help="replicas sampled per pick in the "
                    "sampled mode, for pools over 64")
    ap.add_argument("--no-append", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
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
    drows = decisions(args.decisions, args.choices) if args.decisions > 0 else []
    load = f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after"
    header = ["mode", "setup", "pairs", "direct p50 ms", "routed p50 ms", "added p50 ms",
              "added p99 ms", "<= 1 ms"]
    notes = ("Sequential requests on loopback, direct and routed calls alternated; 'added' is "
             f"the per-pair difference. {os.cpu_count()} CPUs, {load}.")
    dheader = ["replicas", "mode", "scored", "picks", "p50 ms", "p99 ms", "CPU ms / pick"]
    dnotes = ("`RouterContext.pick` in-process: candidates built from the registry and the "
              "router's load account (three streams in flight per replica), then the policy; "
              f"'all' scores every candidate, 'sampled' {args.choices} of them plus the prefix "
              f"affinity target when the pool is over 64; the two alternated call by call. {load}.")
    if args.no_append:
        for h, rs in ((header, rows), (dheader, drows)):
            print(" | ".join(h))
            for row in rs:
                print(" | ".join(row))
    else:
        print(append_rows(f"Router overhead (scripts/bench_router.py), {os.cpu_count()} CPUs",
                          header, rows, notes))
        if drows:
            print(append_rows("Routing decision cost by fleet size (scripts/bench_router.py)",
                              dheader, drows, dnotes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
