#!/usr/bin/env bash
# A multi-host run on one machine: three network namespaces are three hosts. Two run a fake
# replica each (host A with a small KV cache, host B with twice as much), the third runs the
# router, which finds them by a discovery file. Traffic goes through the router while host B's
# link is cut (`ip link set eth0 down`) and restored. It shows, and checks:
#   - nothing is lost: every (non-streamed) request succeeds, the cut one's moving to host A;
#   - host B is evicted by the router's health checks and re-admitted after the link returns;
#   - KV is a fit constraint, not a score, while both hosts have room: both take work.
# Needs root (ip netns) and iproute2; no network access. Prints a summary and a final line
# `RESULT {json}`; exits 0 when every check passed. Everything it creates (namespaces, links,
# processes, a temporary folder) is removed on exit, however it ends.
#   sudo scripts/multihost_demo.sh        (env: PYTHON, MULTIHOST_ID, MULTIHOST_KEEP=1 keeps logs)
#   sudo scripts/multihost_demo.sh cells  (the same with two cells: scripts/multihost_cells_demo.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# `multihost_demo.sh cells`: two cells behind the global balancer, one cell cut mid-run.
if [ "${1:-}" = cells ]; then
    exec bash scripts/multihost_cells_demo.sh
fi

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
if ! command -v ip >/dev/null 2>&1; then
    echo "multihost_demo: needs the ip tool (iproute2)" >&2
    exit 2
fi

# Three hosts as namespaces; everything is removed on exit (scripts/netns_hosts.sh).
source scripts/netns_hosts.sh
three_hosts multihost_demo bmh

# Replicas: the fake engine (real scheduler and KV block pool, simulated model step).
replica() {  # NS ADDRESS BLOCKS NAME
    ip netns exec "$1" "$PY" -m batcher.app.cli serve --model fake --embedding-model none \
        --host "$2" --port 8000 --num-blocks "$3" --fake-decode-step-ms 10 \
        --shutdown-timeout 2 --log-level warning >"$WORK/$4.log" 2>&1 &
    PIDS+=($!)
}
replica "$NS_A" 10.200.1.2 64 host-a
replica "$NS_B" 10.200.2.2 128 host-b
printf 'http://10.200.1.2:8000\nhttp://10.200.2.2:8000\n' >"$WORK/replicas.txt"

# The router. Unique prompts share no prefix, so affinity is off and only free KV decides. The
# retry budget must cover the largest share of traffic one failure can strand: with two hosts,
# one host's in-flight work is most of it, far above the 10% default sized for larger fleets.
ip netns exec "$NS_R" "$PY" -m batcher.app.cli router --host 0.0.0.0 --port 8000 \
    --admin-port 8001 --admin-key demo --discover "file:$WORK/replicas.txt" \
    --affinity-chars 0 --retry-ratio 1.0 --shutdown-timeout 2 --log-level warning \
    >"$WORK/router.log" 2>&1 &
PIDS+=($!)

echo "multihost_demo: hosts $NS_A (10.200.1.2, 64 KV blocks), $NS_B (10.200.2.2, 128 KV" \
     "blocks), router in $NS_R"

# The driver runs on the router's host; it cuts and restores host B's link itself, so each step
# waits for the previous one's effect instead of guessing durations.
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

ROUTER, ADMIN = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
A, B = "10.200.1.2:8000", "10.200.2.2:8000"
CONCURRENCY, MAX_TOKENS, DEADLINE = 16, 48, time.monotonic() + 50.0
FILLER = "the quick brown fox jumps over the lazy dog " * 4


def left() -> float:
    return DEADLINE - time.monotonic()


async def status(s: aiohttp.ClientSession) -> dict[str, dict]:
    async with s.get(ADMIN + "/admin/status", headers={"Authorization": "Bearer demo"},
                     timeout=aiohttp.ClientTimeout(total=2)) as r:
        return {x["replica_id"]: x for x in (await r.json())["replicas"]}


async def served(s: aiohttp.ClientSession) -> dict[str, float]:
    async with s.get(ROUTER + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("batcher_router_requests_total{") and 'outcome="ok"' in line:
            rid = line.split('replica="', 1)[1].split('"', 1)[0]
            out[rid] = out.get(rid, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def until(cond, what: str, timeout: float) -> float:
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


async def main() -> dict:
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
                    async with s.post(ROUTER + "/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=30)) as r:
                        await r.read()
                        results.append((r.status, r.headers.get("X-Attempt", "1")))
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
            after = await served(s)
            return {k: after.get(k, 0) - before.get(k, 0) for k in (A, B)}, free

        workers = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)]
        try:
            both, free = await phase(4.0)
            # NOTE: counted from after the cut: an answer B finished while the cut command was
            # starting is not one served while cut
            subprocess.run(shlex.split(os.environ["CUT"]), check=True)
            base = await served(s)
            print(f"  link of host B cut ({os.environ['CUT']})", flush=True)
            evict_s = await until(lambda: evicted(s, True), "host B evicted", 15)
            print(f"  host B evicted {evict_s:.1f}s after the cut", flush=True)
            await asyncio.sleep(2.0)  # traffic meanwhile runs on host A alone
            cut = {k: v - base.get(k, 0) for k, v in (await served(s)).items()}
            subprocess.run(shlex.split(os.environ["RESTORE"]), check=True)
            print("  link of host B restored", flush=True)
            readmit_s = await until(lambda: evicted(s, False), "host B re-admitted", 20)
            print(f"  host B re-admitted {readmit_s:.1f}s after the restore", flush=True)
            again, _ = await phase(3.0)
        finally:
            stop.set()
            await asyncio.gather(*workers)
        view = await status(s)
    failed = [r for r in results if r[0] != 200]
    return {"requests": len(results), "failed": len(failed), "failures": failed[:10],
            "retried": sum(1 for _, a in results if a not in ("1", "")),
            "evicted_after_s": round(evict_s, 2), "readmitted_after_s": round(readmit_s, 2),
            "served_both_up": both, "served_while_cut": {k: cut.get(k, 0) for k in (A, B)},
            "served_after_restore": again,
            "mean_free_blocks_both_up": {k: round(sum(v) / max(1, len(v)), 1)
                                         for k, v in free.items()},
            "total_blocks": {k: view[k]["total_blocks"] for k in (A, B)},
            "evictions_of_b": view[B].get("health", {}).get("evictions")}


async def ready(s: aiohttp.ClientSession) -> bool:
    st = await status(s)
    return all(st.get(k, {}).get("routable") for k in (A, B))


async def evicted(s: aiohttp.ClientSession, want: bool) -> bool:
    v = (await status(s))[B]
    return v["evicted"] is want and (want or v["routable"])


out = asyncio.run(main())
checks = {
    "nothing lost": out["failed"] == 0 and out["requests"] > 0,
    "host B evicted and re-admitted": out["evictions_of_b"] == 1,
    "host A carried the traffic while B was cut": out["served_while_cut"][A] > 0,
    "host B served again after re-admission": out["served_after_restore"][B] > 0,
    # KV is a fit constraint, and a score only when scarce: at this load both hosts share the work.
    "both hosts took work while up": min(out["served_both_up"].values()) > 0,
}
print(f"  {out['requests']} requests, {out['failed']} failed, {out['retried']} needed a retry")
print(f"  served with both hosts up: {out['served_both_up']}  (KV blocks {out['total_blocks']};"
      f" mean free {out['mean_free_blocks_both_up']})")
print(f"  served while B was cut: {out['served_while_cut']};"
      f" after re-admission: {out['served_after_restore']}")
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
    echo "multihost_demo: FAILED (exit $rc); router log tail:" >&2
    tail -n 20 "$WORK/router.log" >&2 || true
fi
exit "$rc"
