"""The traffic and the checks of the multi-host demos (scripts/multihost_demo.sh).

    python scripts/multihost_driver.py hosts   # the router over two hosts' replicas
    python scripts/multihost_driver.py cells   # the balancer over two cells' routers

Run on the front host (its namespace): 16 clients send completions through the front (the router,
or the balancer) at 127.0.0.1:8000 while host B's link is cut and restored by the commands in the
environment (CUT, RESTORE), each step waiting for the previous one's effect (read from the
front's /admin/status on 127.0.0.1:8001) instead of guessing durations. Prints a summary, the
checks and a final line `RESULT {json}`; exits 0 when every check passed. Only the standard
library and aiohttp: it runs with any Python that has them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp

FRONT, ADMIN = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
A, B = "10.200.1.2:8000", "10.200.2.2:8000"
CONCURRENCY, MAX_TOKENS = 16, 48
FILLER = "the quick brown fox jumps over the lazy dog " * 4
# The whole run's bound: a cell is a router and a replica to start behind the balancer.
RUN_S = {"hosts": 50.0, "cells": 150.0}
DEADLINE = time.monotonic() + RUN_S["hosts"]


def left() -> float:
    return DEADLINE - time.monotonic()


async def status(s: aiohttp.ClientSession) -> dict[str, dict]:
    async with s.get(ADMIN + "/admin/status", headers={"Authorization": "Bearer demo"},
                     timeout=aiohttp.ClientTimeout(total=2)) as r:
        return {x["replica_id"]: x for x in (await r.json())["replicas"]}


async def served(s: aiohttp.ClientSession) -> dict[str, float]:
    """Answers served per upstream (replica or cell) so far, from the front's /metrics."""
    async with s.get(FRONT + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("batcher_router_requests_total{") and 'outcome="ok"' in line:
            rid = line.split('replica="', 1)[1].split('"', 1)[0]
            out[rid] = out.get(rid, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def served_since(s: aiohttp.ClientSession, before: dict[str, float]) -> dict[str, float]:
    after = await served(s)
    return {k: after.get(k, 0) - before.get(k, 0) for k in (A, B)}


async def until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float) -> float:
    """Seconds until `cond()` held; raises when it did not within `timeout` (or the run's end)."""
    start = time.monotonic()
    while time.monotonic() - start < min(timeout, left()):
        try:
            if await cond():
                return time.monotonic() - start
        except (aiohttp.ClientError, TimeoutError, KeyError):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(what)


async def ready(s: aiohttp.ClientSession) -> bool:
    st = await status(s)
    return all(st.get(k, {}).get("routable") for k in (A, B))


async def evicted(s: aiohttp.ClientSession, want: bool) -> bool:
    v = (await status(s))[B]
    return v["evicted"] is want and (want or v["routable"])


def run_command(var: str) -> None:
    subprocess.run(shlex.split(os.environ[var]), check=True)


async def post(s: aiohttp.ClientSession, body: dict, headers: dict[str, str] | None = None
               ) -> tuple[int, str, str | None]:
    """(status, X-Attempt, Retry-After of a 429/503) of one completion; raises on no answer."""
    async with s.post(FRONT + "/v1/completions", json=body, headers=headers,
                      timeout=aiohttp.ClientTimeout(total=30)) as r:
        await r.read()
        wait = r.headers.get("Retry-After") if r.status in (429, 503) else None
        return r.status, r.headers.get("X-Attempt", "1"), wait


async def hosts() -> dict:
    """The router over a replica on each host: KV is a fit constraint while both have room."""
    results: list[tuple[int, str]] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as s:
        await until(lambda: ready(s), "both replicas routable", 40)
        counter = iter(range(10**6))

        async def worker() -> None:
            while not stop.is_set():
                i = next(counter)
                body = {"model": "fake", "prompt": f"request {i}: {FILLER}",
                        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                try:
                    st, attempt, _ = await post(s, body)
                    results.append((st, attempt))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    results.append((0, type(exc).__name__))

        async def phase(seconds: float) -> tuple[dict[str, float], dict[str, list[int]]]:
            """Served per replica and free-KV samples over `seconds` of traffic."""
            before, free = await served(s), {A: [], B: []}
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for rid, v in (await status(s)).items():
                    if v["routable"] and v["free_blocks"] is not None:
                        free[rid].append(v["free_blocks"])
                await asyncio.sleep(0.1)
            return await served_since(s, before), free

        workers = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)]
        try:
            both, free = await phase(4.0)
            # NOTE: counted from after the cut: an answer B finished while the cut command was
            # starting is not one served while cut
            run_command("CUT")
            base = await served(s)
            print(f"  link of host B cut ({os.environ['CUT']})", flush=True)
            evict_s = await until(lambda: evicted(s, True), "host B evicted", 15)
            print(f"  host B evicted {evict_s:.1f}s after the cut", flush=True)
            await asyncio.sleep(2.0)  # traffic meanwhile runs on host A alone
            cut = await served_since(s, base)
            run_command("RESTORE")
            print("  link of host B restored", flush=True)
            readmit_s = await until(lambda: evicted(s, False), "host B re-admitted", 20)
            print(f"  host B re-admitted {readmit_s:.1f}s after the restore", flush=True)
            again, _ = await phase(3.0)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        view = await status(s)
    failed = [r for r in results if r[0] != 200]
    out = {"requests": len(results), "failed": len(failed), "failures": failed[:10],
           "retried": sum(1 for _, a in results if a not in ("1", "")),
           "evicted_after_s": round(evict_s, 2), "readmitted_after_s": round(readmit_s, 2),
           "served_both_up": both, "served_while_cut": cut, "served_after_restore": again,
           "mean_free_blocks_both_up": {k: round(sum(v) / max(1, len(v)), 1)
                                        for k, v in free.items()},
           "total_blocks": {k: view[k]["total_blocks"] for k in (A, B)},
           "evictions_of_b": view[B].get("health", {}).get("evictions")}
    out["checks"] = {
        "nothing lost": out["failed"] == 0 and out["requests"] > 0,
        "host B evicted and re-admitted": out["evictions_of_b"] == 1,
        "host A carried the traffic while B was cut": cut[A] > 0,
        "host B served again after re-admission": again[B] > 0,
        # KV is a fit constraint, and a score only when scarce: at this load both hosts share it.
        "both hosts took work while up": min(both.values()) > 0,
    }
    print(f"  {out['requests']} requests, {out['failed']} failed, {out['retried']} needed a retry")
    print(f"  served with both hosts up: {both}  (KV blocks {out['total_blocks']};"
          f" mean free {out['mean_free_blocks_both_up']})")
    print(f"  served while B was cut: {cut}; after re-admission: {again}")
    return out


async def cells() -> dict:
    """The balancer over two cells, each a router and its replica on one host."""
    results: list[tuple[int, str]] = []
    shed = [0, 0]  # answers of 503/429 + Retry-After; requests still refused when the run stopped
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as s:
        await until(lambda: ready(s), "both cells routable", 100)
        counter = iter(range(10**6))

        async def worker(k: int) -> None:
            # Each worker is a tenant of its own (its key), so both cells are someone's home.
            headers = {"Authorization": f"Bearer tenant-{k}"}
            while not stop.is_set():
                i = next(counter)
                body = {"model": "fake", "prompt": f"request {i}", "max_tokens": MAX_TOKENS,
                        "temperature": 0, "ignore_eos": True}
                while True:
                    try:
                        st, attempt, wait = await post(s, body, headers)
                        if wait is None:
                            results.append((st, attempt))
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        results.append((0, type(exc).__name__))
                        break
                    if wait is None:
                        break
                    # Shed while every cell was saturated: as a client does, wait as told and
                    # send it again. Refused, not lost, unless it was still refused at the end.
                    shed[0] += 1
                    if stop.is_set():
                        shed[1] += 1
                        break
                    await asyncio.sleep(float(wait))

        async def phase(seconds: float) -> dict[str, float]:
            before = await served(s)
            await asyncio.sleep(seconds)
            return await served_since(s, before)

        # A cell with no routable replica yet is evicted at start: count from here.
        evictions0 = (await status(s))[B].get("health", {}).get("evictions", 0)
        workers = [asyncio.create_task(worker(k)) for k in range(CONCURRENCY)]
        try:
            both = await phase(4.0)
            run_command("CUT")
            print(f"  link of cell B cut ({os.environ['CUT']})", flush=True)
            evict_s = await until(lambda: evicted(s, True), "cell B evicted", 15)
            print(f"  cell B evicted {evict_s:.1f}s after the cut", flush=True)
            cut = await phase(2.0)
            run_command("RESTORE")
            print("  link of cell B restored", flush=True)
            readmit_s = await until(lambda: evicted(s, False), "cell B re-admitted", 20)
            print(f"  cell B re-admitted {readmit_s:.1f}s after the restore", flush=True)
            again = await phase(3.0)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        view = await status(s)
    failed = [r for r in results if r[0] != 200]
    out = {"requests": len(results), "failed": len(failed), "failures": failed[:10],
           "shed_answers": shed[0], "shed_at_the_end": shed[1],
           "retried": sum(1 for _, a in results if a not in ("1", "")),
           "evicted_after_s": round(evict_s, 2), "readmitted_after_s": round(readmit_s, 2),
           "served_both_up": both, "served_while_cut": cut, "served_after_restore": again,
           "evictions_of_b": view[B].get("health", {}).get("evictions", 0) - evictions0}
    out["checks"] = {
        "nothing lost": out["failed"] == 0 and out["requests"] > 0,
        "cell B evicted and re-admitted": out["evictions_of_b"] == 1,
        "both cells served while up": min(both.values()) > 0,
        "cell A carried the traffic while B was cut": cut[A] > 0 and cut[B] == 0,
        "cell B served again after re-admission": again[B] > 0,
    }
    print(f"  {out['requests']} requests, {out['failed']} failed, {out['retried']} needed a retry,"
          f" {out['shed_answers']} answers shed with Retry-After (sent again after it;"
          f" {out['shed_at_the_end']} still refused when the run stopped)")
    print(f"  served with both cells up: {both}; while B was cut: {cut}; after re-admission:"
          f" {again}")
    return out


def main(argv: list[str]) -> int:
    global DEADLINE
    if len(argv) != 1 or argv[0] not in RUN_S:
        print(f"usage: {sys.argv[0]} hosts|cells", file=sys.stderr)
        return 2
    DEADLINE = time.monotonic() + RUN_S[argv[0]]
    out = asyncio.run(hosts() if argv[0] == "hosts" else cells())
    for name, ok in out["checks"].items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
