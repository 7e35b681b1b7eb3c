#!/usr/bin/env bash
# Two cells on one machine: three network namespaces are three hosts. Hosts A and B each run a
# cell (a fake replica on the host's loopback and a router in front of it); the third runs the
# global balancer over the two cells' routers. Traffic goes through the balancer while cell B's
# link is cut (`ip link set eth0 down`) and restored. It shows, and checks:
#   - nothing is lost: every (non-streamed) request succeeds, those caught in cell B moving to A;
#   - cell B is evicted by the balancer's health checks and re-admitted after the link returns;
#   - both cells take traffic while both are up, and B again after its return.
# Needs root (ip netns) and iproute2; no network access. Prints a summary and a final line
# `RESULT {json}`; exits 0 when every check passed. Everything it creates (namespaces, links,
# processes, a temporary folder) is removed on exit, however it ends.
#   sudo scripts/multihost_demo.sh cells   (env: PYTHON, MULTIHOST_ID, MULTIHOST_KEEP=1 keeps logs)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
if ! command -v ip >/dev/null 2>&1; then
    echo "multihost_cells_demo: needs the ip tool (iproute2)" >&2
    exit 2
fi

# Three hosts as namespaces; everything is removed on exit (scripts/netns_hosts.sh).
source scripts/netns_hosts.sh
three_hosts multihost_cells_demo bmc

cell() {  # NS ADDRESS NAME: a fake replica on the host's loopback, its router on the link
    ip netns exec "$1" "$PY" -m batcher.app.cli serve --model fake --embedding-model none \
        --host 127.0.0.1 --port 8100 --num-blocks 128 --fake-decode-step-ms 10 \
        --shutdown-timeout 2 --log-level warning >"$WORK/$3-replica.log" 2>&1 &
    PIDS+=($!)
    BATCHER_ADMIN_KEY=demo ip netns exec "$1" "$PY" -m batcher.app.cli router --host "$2" \
        --port 8000 --replica http://127.0.0.1:8100 --shutdown-timeout 2 \
        --log-level warning >"$WORK/$3-router.log" 2>&1 &
    PIDS+=($!)
}
cell "$NS_A" 10.200.1.2 cell-a
cell "$NS_B" 10.200.2.2 cell-b

# The balancer. With two cells, one cell's in-flight work is half of everything: the retry budget
# must cover it, far above the share sized for many cells.
ip netns exec "$NS_R" "$PY" -m batcher.app.cli balancer --host 0.0.0.0 --port 8000 \
    --cell http://10.200.1.2:8000 --cell http://10.200.2.2:8000 --admin-port 8001 \
    --admin-key demo --cell-key demo --retry-ratio 1.0 --shutdown-timeout 2 --log-level warning \
    >"$WORK/balancer.log" 2>&1 &
PIDS+=($!)

echo "multihost_cells_demo: cells on $NS_A (10.200.1.2) and $NS_B (10.200.2.2), balancer in $NS_R"

CUT="ip -n $NS_B link set eth0 down" RESTORE="ip -n $NS_B link set eth0 up" \
    ip netns exec "$NS_R" "$PY" - <<'DRIVER' &
from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time

import aiohttp

TOP, ADMIN = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
A, B = "10.200.1.2:8000", "10.200.2.2:8000"
CONCURRENCY, MAX_TOKENS, DEADLINE = 16, 48, time.monotonic() + 150.0


def left() -> float:
    return DEADLINE - time.monotonic()


async def status(s: aiohttp.ClientSession) -> dict[str, dict]:
    async with s.get(ADMIN + "/admin/status", headers={"Authorization": "Bearer demo"},
                     timeout=aiohttp.ClientTimeout(total=2)) as r:
        return {x["replica_id"]: x for x in (await r.json())["replicas"]}


async def served(s: aiohttp.ClientSession) -> dict[str, float]:
    async with s.get(TOP + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("batcher_router_requests_total{") and 'outcome="ok"' in line:
            cid = line.split('replica="', 1)[1].split('"', 1)[0]
            out[cid] = out.get(cid, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def until(cond, what: str, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < min(timeout, left()):
        try:
            if await cond():
                return time.monotonic() - start
        except (aiohttp.ClientError, TimeoutError, KeyError):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(what)


async def main() -> dict:
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
                        async with s.post(TOP + "/v1/completions", json=body, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=30)) as r:
                            await r.read()
                            wait = r.headers.get("Retry-After") if r.status in (429, 503) else None
                            if wait is None:
                                results.append((r.status, r.headers.get("X-Attempt", "1")))
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
            after = await served(s)
            return {k: after.get(k, 0) - before.get(k, 0) for k in (A, B)}

        # A cell with no routable replica yet is evicted at start: count from here.
        evictions0 = (await status(s))[B].get("health", {}).get("evictions", 0)
        workers = [asyncio.create_task(worker(k)) for k in range(CONCURRENCY)]
        try:
            both = await phase(4.0)
            subprocess.run(shlex.split(os.environ["CUT"]), check=True)
            print(f"  link of cell B cut ({os.environ['CUT']})", flush=True)
            evict_s = await until(lambda: evicted(s, True), "cell B evicted", 15)
            print(f"  cell B evicted {evict_s:.1f}s after the cut", flush=True)
            cut = await phase(2.0)
            subprocess.run(shlex.split(os.environ["RESTORE"]), check=True)
            print("  link of cell B restored", flush=True)
            readmit_s = await until(lambda: evicted(s, False), "cell B re-admitted", 20)
            print(f"  cell B re-admitted {readmit_s:.1f}s after the restore", flush=True)
            again = await phase(3.0)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        view = await status(s)
    failed = [r for r in results if r[0] != 200]
    return {"requests": len(results), "failed": len(failed), "failures": failed[:10],
            "shed_answers": shed[0], "shed_at_the_end": shed[1],
            "retried": sum(1 for _, a in results if a not in ("1", "")),
            "evicted_after_s": round(evict_s, 2), "readmitted_after_s": round(readmit_s, 2),
            "served_both_up": both, "served_while_cut": cut, "served_after_restore": again,
            "evictions_of_b": view[B].get("health", {}).get("evictions", 0) - evictions0}


async def ready(s: aiohttp.ClientSession) -> bool:
    st = await status(s)
    return all(st.get(k, {}).get("routable") for k in (A, B))


async def evicted(s: aiohttp.ClientSession, want: bool) -> bool:
    v = (await status(s))[B]
    return v["evicted"] is want and (want or v["routable"])


out = asyncio.run(main())
checks = {
    "nothing lost": out["failed"] == 0 and out["requests"] > 0,
    "cell B evicted and re-admitted": out["evictions_of_b"] == 1,
    "both cells served while up": min(out["served_both_up"].values()) > 0,
    "cell A carried the traffic while B was cut": out["served_while_cut"][A] > 0
    and out["served_while_cut"][B] == 0,
    "cell B served again after re-admission": out["served_after_restore"][B] > 0,
}
print(f"  {out['requests']} requests, {out['failed']} failed, {out['retried']} needed a retry,"
      f" {out['shed_answers']} answers shed with Retry-After (sent again after it;"
      f" {out['shed_at_the_end']} still refused when the run stopped)")
print(f"  served with both cells up: {out['served_both_up']}; while B was cut:"
      f" {out['served_while_cut']}; after re-admission: {out['served_after_restore']}")
for name, ok in checks.items():
    print(f"  [{'ok' if ok else 'FAILED'}] {name}")
print("RESULT " + json.dumps(dict(out, checks=checks)), flush=True)
raise SystemExit(0 if all(checks.values()) else 1)
DRIVER
DRIVER_PID=$!
PIDS+=("$DRIVER_PID")
set +e
wait "$DRIVER_PID"
rc=$?
set -e
if [ "$rc" != 0 ]; then
    echo "multihost_cells_demo: FAILED (exit $rc); balancer log tail:" >&2
    tail -n 20 "$WORK/balancer.log" >&2 || true
fi
exit "$rc"
