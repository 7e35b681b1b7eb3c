"""Router overhead: the latency a router adds to a request, and the routing decision's cost.

The latency a router adds is measured against a direct call to the same fake replica, against a bare
aiohttp forwarder (one handler: read the body, post it upstream on a pooled session, return the
answer; the floor of an aiohttp hop on this machine) and against a socket forwarder (the same
server, the upstream hop hand-written over pooled sockets: what aiohttp's client itself costs), all
alternated call by call so drift hits all alike; and the routing decision alone
(`RouterContext.pick`, in-process) on fleets of 1 to 256 replicas, every candidate scored against a
sample of `--choices`, alternated the same way. Appends rows to BENCHMARKS.md.

    python -m scripts.bench router [--requests 400] [--decisions 2000] [--against REV]
                                   [--no-append]

`--against REV` also runs the router of an earlier revision (its `batcher/` from git, in a
temporary folder) in the same alternation, for a before/after column measured side by side.

Target: the router adds <= 1 ms at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from batcher.bench.common import append_rows, pct, wait_until_up
from batcher.bench.load import process_cpu_seconds
from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice
from scripts.bench._shared import ROOT, parser, rerun, start_checkout

QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "stdin": subprocess.DEVNULL}


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, **QUIET)  # type: ignore[call-overload]


def cpu_seconds(proc: subprocess.Popen) -> float | None:
    """User + system CPU the process has used (Linux /proc; None elsewhere)."""
    return process_cpu_seconds(proc.pid)


def checkout(rev: str, into: Path) -> None:
    """`batcher/` as it was at `rev`, under `into` (run from there, it is what imports)."""
    archive = subprocess.run(["git", "archive", rev, "batcher"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    if not wait_until_up(url, proc, timeout, interval=0.1):
        raise SystemExit(f"a process exited early (code {proc.returncode})"
                         if proc.poll() is not None else f"{url} did not come up")


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


async def measure(urls: list[str], n: int, stream: bool) -> list[list[float]]:
    """Seconds per call to each of `urls`, called in turn (the order flipped every round)."""
    body = orjson.dumps({"model": "fake", "prompt": "benchmark the router", "max_tokens": 1,
                         "temperature": 0, "stream": stream})
    out: list[list[float]] = [[] for _ in urls]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(20):  # warm every path (connections, caches)
            for url in urls:
                await timed(s, url, body, stream)
        for i in range(n):
            order = list(range(len(urls)))
            for j in order if i % 2 else order[::-1]:
                out[j].append(await timed(s, urls[j], body, stream))
    return out


def bare_forwarder(port: int, upstream: str) -> None:
    """The floor: an aiohttp app that forwards POST /v1/completions and nothing else."""
    import uvloop
    from aiohttp import web

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        async with request.app[SESSION].post(upstream + request.path, data=raw, headers={
                "Content-Type": "application/json"}) as up:
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status,
                                    content_type=up.content_type)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def session(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    SESSION = web.AppKey("session", aiohttp.ClientSession)
    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/ready", lambda _: web.Response(text="ok"))
    app.cleanup_ctx.append(session)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                loop=uvloop.new_event_loop())


def socket_forwarder(port: int, upstream: str) -> None:
    """A lower floor: the same aiohttp server, but the upstream hop on hand-written HTTP/1.1 over
    pooled asyncio streams instead of aiohttp's client (a reference for the client's own cost:
    no timeouts, no error handling, the fake replica's answers only)."""
    import uvloop
    from aiohttp import web

    host, _, uport = upstream.removeprefix("http://").partition(":")
    pool: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        r, w = pool.pop() if pool else await asyncio.open_connection(host, int(uport))
        w.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (request.path.encode(), host.encode(),
                                                    len(raw), raw))
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        status = int(head[9:12])
        if b"transfer-encoding: chunked" not in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            body = await r.readexactly(length)
            pool.append((r, w))
            return web.Response(body=body, status=status, content_type="application/json")
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while size := int(await r.readuntil(b"\r\n"), 16):
            await resp.write((await r.readexactly(size + 2))[:-2])
        await r.readexactly(2)
        pool.append((r, w))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/ready", lambda _: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                loop=uvloop.new_event_loop())


def decision_context(replicas: int, choices: int, streams: int = 3) -> Any:
    """A router context whose registry holds `replicas` reporting replicas, each with `streams`
    of the router's own streams in flight (so the load account has something to read)."""
    from batcher.fleet.router.context import RouterConfig, RouterContext
    from batcher.fleet.router.policy import PolicyConfig

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


def main(argv: list[str]) -> int:
    ap = parser(__name__, __doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="pairs per mode")
    ap.add_argument("--decisions", type=int, default=2000, help="timed picks per fleet size "
                    "and mode (0: skip)")
    ap.add_argument("--choices", type=int, default=8, help="replicas sampled per pick in the "
                    "sampled mode, for pools over 64")
    ap.add_argument("--no-append", action="store_true", help="print, do not touch BENCHMARKS.md")
    ap.add_argument("--against", metavar="REV", help="also run this revision's router")
    ap.add_argument("--bare-forwarder", nargs=2, metavar=("PORT", "UPSTREAM"),
                    help=argparse.SUPPRESS)  # the reference forwarder's own process
    ap.add_argument("--socket-forwarder", nargs=2, metavar=("PORT", "UPSTREAM"),
                    help=argparse.SUPPRESS)  # the raw-socket reference's own process
    args = ap.parse_args(argv)
    if args.bare_forwarder:
        bare_forwarder(int(args.bare_forwarder[0]), args.bare_forwarder[1])
        return 0
    if args.socket_forwarder:
        socket_forwarder(int(args.socket_forwarder[0]), args.socket_forwarder[1])
        return 0
    load0 = os.getloadavg()[0]
    rport, xport, bport, sport = free_port(), free_port(), free_port(), free_port()
    rep = start([sys.executable, "-m", "batcher.app.cli", "serve", "--model", "fake",
                 "--embedding-model", "none", "--port", str(rport), "--fake-decode-step-ms", "1",
                 "--log-level", "warning"])
    direct = f"http://127.0.0.1:{rport}"
    routed, bare = f"http://127.0.0.1:{xport}", f"http://127.0.0.1:{bport}"
    sock = f"http://127.0.0.1:{sport}"
    router = start([sys.executable, "-m", "batcher.app.cli", "router", "--port", str(xport),
                    "--replica", direct, "--log-level", "warning"])
    forwarder = start(rerun(__name__, "--bare-forwarder", str(bport), direct))
    sockfwd = start(rerun(__name__, "--socket-forwarder", str(sport), direct))
    procs = [sockfwd, forwarder, router, rep]
    urls = [direct, routed, bare, sock]
    old_tree = tempfile.TemporaryDirectory(prefix="bench-router-") if args.against else None
    try:
        if old_tree is not None:
            checkout(args.against, Path(old_tree.name))
            oport = free_port()
            procs.append(start_checkout(Path(old_tree.name), "router", "--port", str(oport),
                                        "--replica", direct, "--log-level", "warning", **QUIET))
            urls.append(f"http://127.0.0.1:{oport}")
        for url, proc in zip(urls, [rep, router, forwarder, sockfwd, *procs[4:]]):
            wait_up(url + "/ready", proc)
        rows = []
        # CPU per request of each forwarding process, over the whole alternation (the replica's
        # is shared, so not shown): less noisy than latency on a shared machine.
        servers = [router, forwarder, sockfwd, *procs[4:]]
        for stream in (False, True):
            before = [cpu_seconds(p) for p in servers]
            d, r, b, k, *o = asyncio.run(measure(urls, args.requests, stream))
            cpu = [None if x is None or (y := cpu_seconds(p)) is None
                   else (y - x) / args.requests * 1000 for p, x in zip(servers, before)]
            added = [(y - x) * 1000 for x, y in zip(d, r)]
            floor = [(y - x) * 1000 for x, y in zip(d, b)]
            raw_floor = [(y - x) * 1000 for x, y in zip(d, k)]
            mode = "stream, first event" if stream else "whole answer"
            row = [mode, "1 fake replica, max_tokens 1", str(args.requests),
                   f"{pct(d, 50) * 1000:.2f}", f"{pct(r, 50) * 1000:.2f}",
                   f"{pct(added, 50):.2f}", f"{pct(added, 99):.2f}",
                   f"{pct(floor, 50):.2f}", f"{pct(raw_floor, 50):.2f}"]
            if o:
                earlier = [(y - x) * 1000 for x, y in zip(d, o[0])]
                row.append(f"{pct(earlier, 50):.2f}")
            row.append(" / ".join("-" if c is None else f"{c:.2f}" for c in cpu))
            rows.append([*row, "yes" if pct(added, 50) <= 1.0 else "no"])
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        if old_tree is not None:
            old_tree.cleanup()
    drows = decisions(args.decisions, args.choices) if args.decisions > 0 else []
    load = f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after"
    header = ["mode", "setup", "rounds", "direct p50 ms", "routed p50 ms", "added p50 ms",
              "added p99 ms", "bare forwarder added p50 ms", "socket forwarder added p50 ms",
              *([f"router at {args.against} added p50 ms"] if args.against else []),
              "CPU ms / request: router / bare / socket"
              + (f" / router at {args.against}" if args.against else ""), "<= 1 ms"]
    notes = ("Sequential requests on loopback, direct, routed, bare-forwarder (aiohttp server "
             "and client) and socket-forwarder (aiohttp server, hand-written upstream HTTP/1.1) "
             "calls alternated; 'added' is the per-round difference from the direct call; CPU: "
             "each forwarding process's user + system time over the mode's calls, per call. "
             f"{os.cpu_count()} CPUs, {load}.")
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
        print(append_rows(f"Router overhead (scripts/bench/router.py), {os.cpu_count()} CPUs",
                          header, rows, notes))
        if drows:
            print(append_rows("Routing decision cost by fleet size (scripts/bench/router.py)",
                              dheader, drows, dnotes))
    return 0

