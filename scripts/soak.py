"""Soak: mixed traffic against one server (or a local fleet) for a long time, watching for leaks.

    python scripts/soak.py [--duration 1800] [--rate 20] [--url URL]
                           [--fleet 3 --kill-every 120] [--json out.json]

Without `--url` it starts `batcher serve --model fake` (real scheduler and block pool, simulated
steps) on a free loopback port, with three tenants, and stops it at the end. `--fleet N` starts
`batcher fleet --model fake --replicas N --restart` instead and SIGKILLs one replica every
`--kill-every` seconds (the router must retry or fail each affected request explicitly).

Traffic, open loop at `--rate` requests/s: streamed and whole completions and chats, streams the
client drops mid-way, requests cancelled by their owner (DELETE), invalid requests (400) and a
tenant far over its budget (429). Every request must end in a definite answer: a status, or a
stream that ends with [DONE] (or an explicit error event). A request with no answer (connection
reset, time-out, a stream that just stops) is LOST.

Every `--sample-every` seconds it records the server's open file descriptors, resident memory and
asyncio task count (`process_open_fds`, `process_resident_memory_bytes`, `batcher_asyncio_tasks`
from /metrics; the fleet's router process from /proc), then reports least-squares slopes per
minute after the warm-up, and the values once the server is idle again at the end.

Exit status: 0 when nothing was lost and the slopes are under the `--max-*-slope` limits.
Not part of CI (it runs for minutes); RELIABILITY.md records its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice
from batcher.server.auth import hash_key

ROOT = Path(__file__).resolve().parent.parent

KEYS = {"steady": "soak-steady-key", "bursty": "soak-bursty-key", "greedy": "soak-greedy-key"}
MAX_IN_FLIGHT = 256
SLOPE_MIN_DURATION_S = 600.0
REQUEST_TIMEOUT_S = 60.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# The server under test --------------------------------------------------------------------------


def write_tenants(path: Path) -> None:
    # (tokens per minute, burst, max concurrent); "greedy" affords about one request a minute,
    # so nearly everything it sends is a 429.
    rows = {"steady": (600_000, 600_000, 256), "bursty": (600_000, 600_000, 256),
            "greedy": (600, 600, 4)}
    lines = []
    for name, (tpm, burst, conc) in rows.items():
        lines += [f"[tenants.{name}]", f'keys_sha256 = ["{hash_key(KEYS[name])}"]',
                  f"tokens_per_minute = {tpm}", f"burst = {burst}", f"max_concurrent = {conc}",
                  ""]
    path.write_text("\n".join(lines))


@dataclass
class Target:
    url: str
    proc: subprocess.Popen[bytes] | None = None
    fleet: bool = False
    log_path: Path | None = None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def replica_pids(self) -> list[int]:
        """The fleet's replica processes: the children of the fleet process."""
        if self.proc is None:
            return []
        pids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
        return pids


def start_target(args: argparse.Namespace, tmp: Path) -> Target:
    port = free_port()
    tenants = tmp / "tenants.toml"
    write_tenants(tenants)
    common = ["--model", "fake", "--embedding-model", "none", "--host", "127.0.0.1",
              "--port", str(port), "--tenants", str(tenants), "--fake-decode-step-ms",
              str(args.decode_ms), "--num-blocks", "2048", "--log-level", "warning"]
    if args.fleet:
        argv = ["fleet", *common, "--replicas", str(args.fleet), "--restart"]
    else:
        argv = ["serve", *common]
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "batcher.app.cli", *argv], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    target = Target(f"http://127.0.0.1:{port}", proc, bool(args.fleet), log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log_path.read_text()}")
        try:
            with _OPENER.open(target.url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return target
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    target.stop()
    raise SystemExit("the server was not ready within 120 s")


# Traffic ----------------------------------------------------------------------------------------

@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    sent: int = 0
    skipped: int = 0  # the client already had MAX_IN_FLIGHT requests open

    def lose(self, kind: str, why: str) -> None:
        self.outcomes["LOST"] += 1
        if len(self.lost) < 20:
            self.lost.append(f"{kind}: {why}")


async def read_stream(resp: aiohttp.ClientResponse, drop_after: int | None = None
                      ) -> str:
    """'done', 'error-event' (explicit), 'dropped' (by us) or 'truncated' (lost)."""
    events = 0
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return "done" if finished else "truncated"
        ev = orjson.loads(data)
        if "error" in ev:
            return "error-event"
        events += 1
        finished = finished or any(c.get("finish_reason") for c in ev.get("choices", []))
        if drop_after is not None and events >= drop_after:
            return "dropped"
    return "truncated"


async def one_request(session: aiohttp.ClientSession, url: str, kind: str, i: int,
                      rng: random.Random, tally: Tally) -> None:
    auth = {"Authorization": f"Bearer {KEYS['greedy' if kind == 'over-budget' else 'steady']}"}
    rid = f"soak-{i}"
    headers = {**auth, "X-Request-Id": rid}
    max_tokens = rng.randint(8, 64)
    prompt = f"soak request {i}: " + "lorem ipsum " * rng.randint(1, 40)
    body: dict[str, Any] = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True}
    path = "/v1/completions"
    stream = kind in ("stream", "drop", "cancel", "chat-stream")
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"model": "fake", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "ignore_eos": True}
    if kind == "invalid":
        body["temperature"] = "hot"
    body["stream"] = stream
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with session.post(url + path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    await resp.read()
                    ok_status = {"invalid": (400,), "over-budget": (429,)}.get(kind, ())
                    if resp.status in ok_status:
                        tally.outcomes[f"{kind}:expected-{resp.status}"] += 1
                    elif resp.status in (429, 503) and resp.headers.get("Retry-After"):
                        tally.outcomes[f"rejected-{resp.status}"] += 1
                    elif resp.status >= 500:
                        tally.outcomes[f"failed-{resp.status}"] += 1
                    else:
                        tally.outcomes[f"unexpected-{resp.status}"] += 1
                        if len(tally.unexpected) < 10:
                            tally.unexpected.append(f"{kind} {rid}: {resp.status} "
                                                    f"{(await resp.text())[:200]}")
                    return
                if not stream:
                    answer = await resp.json()
                    reason = answer["choices"][0]["finish_reason"]
                    tally.outcomes[f"{kind}:{reason}"] += 1
                    return
                if kind == "cancel":
                    async def cancel_soon() -> None:
                        await asyncio.sleep(rng.uniform(0.05, 0.3))
                        async with session.delete(url + f"/v1/requests/{rid}",
                                                  headers=auth) as d:
                            await d.read()
                    canceller = asyncio.create_task(cancel_soon())
                    result = await read_stream(resp)
                    await canceller
                    # A cancelled stream ends with an error event or finishes first: both fine.
                    result = "cancelled" if result in ("error-event", "done") else result
                else:
                    drop = rng.randint(1, max_tokens // 2) if kind == "drop" else None
                    result = await read_stream(resp, drop)
                if result == "truncated":
                    tally.lose(kind, f"{rid}: the stream ended without [DONE] or an error")
                else:
                    tally.outcomes[f"{kind}:{result}"] += 1
    except TimeoutError:
        tally.lose(kind, f"{rid}: no answer within {REQUEST_TIMEOUT_S:g}s")
    except aiohttp.ClientError as exc:
        tally.lose(kind, f"{rid}: {type(exc).__name__}: {exc}")


MIX = [("stream", 30), ("whole", 20), ("chat", 8), ("chat-stream", 8), ("drop", 12),
       ("cancel", 7), ("invalid", 5), ("over-budget", 10)]


async def traffic(url: str, rate: float, duration: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    kinds = [k for k, _ in MIX]
    weights = [w for _, w in MIX]
    in_flight: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic()
        i = 0
        while (now := time.monotonic()) < start + duration:
            due = start + i / rate
            if due > now:
                await asyncio.sleep(due - now)
            i += 1
            if len(in_flight) >= MAX_IN_FLIGHT:
                tally.skipped += 1
                continue
            kind = rng.choices(kinds, weights)[0]
            tally.sent += 1
            task = asyncio.create_task(one_request(session, url, kind, i, rng, tally))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight, timeout=REQUEST_TIMEOUT_S + 5)


# Leak watch -------------------------------------------------------------------------------------

@dataclass
class Sample:
    t: float
    fds: float
    rss_mib: float
    tasks: float


def scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def proc_figures(pid: int) -> tuple[float, float]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return float(fds), rss


async def sample(session: aiohttp.ClientSession, target: Target, t0: float) -> Sample:
    async with session.get(target.url + "/metrics") as resp:
        m = scrape(await resp.text())
    if target.fleet and target.proc is not None:
        fds, rss = proc_figures(target.proc.pid)
        tasks = m.get("batcher_asyncio_tasks", float("nan"))
    else:
        fds = m.get("process_open_fds", float("nan"))
        rss = m.get("process_resident_memory_bytes", float("nan")) / 2**20
        tasks = m.get("batcher_asyncio_tasks", float("nan"))
    return Sample(round(time.monotonic() - t0, 1), fds, round(rss, 2), tasks)


async def watch(target: Target, t0: float, every: float, samples: list[Sample],
                stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                samples.append(await sample(session, target, t0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)


async def killer(target: Target, every: float, stop: asyncio.Event, kills: list[str],
                 seed: int) -> None:
    rng = random.Random(seed)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return
        pids = target.replica_pids()
        if pids:
            pid = rng.choice(pids)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                kills.append(f"{time.strftime('%H:%M:%S')} SIGKILL replica pid {pid}")


def slope_per_min(samples: list[Sample], attr: str) -> float:
    xs = [s.t / 60 for s in samples]
    ys = [getattr(s, attr) for s in samples]
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


async def wait_idle(url: str, within: float = 30.0) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + within
        while True:
            async with session.get(url + "/v1/state") as resp:
                st = await resp.json()
            if st.get("running", 0) == 0 and st.get("waiting", 0) == 0 and st.get(
                    "free_blocks") == st.get("total_blocks"):
                return st
            if time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.2)


async def idle_sample(target: Target, t0: float) -> tuple[Sample, dict[str, Any]]:
    """Wait until nothing runs, let closed connections go, then sample."""
    state = await wait_idle(target.url)
    await asyncio.sleep(2.0)
    async with aiohttp.ClientSession() as session:
        return await sample(session, target, t0), state


async def soak(args: argparse.Namespace, target: Target) -> int:
    t0 = time.monotonic()
    where = f"{target.url}{f' (fleet of {args.fleet})' if args.fleet else ''}"
    print(f"soak: {args.warmup:g}s warm-up, then {args.duration:g}s of mixed traffic at "
          f"{args.rate:g} req/s against {where}", flush=True)
    # Warm-up: first-time allocations and imports, so the idle baseline is a fair one.
    await traffic(target.url, args.rate, args.warmup, Tally(), args.seed + 1)
    baseline, _ = await idle_sample(target, t0)

    tally = Tally()
    samples: list[Sample] = []
    kills: list[str] = []
    stop = asyncio.Event()
    t1 = time.monotonic()
    watcher = asyncio.create_task(watch(target, t1, args.sample_every, samples, stop))
    kill_task = None
    if args.fleet and args.kill_every:
        kill_task = asyncio.create_task(killer(target, args.kill_every, stop, kills, args.seed))
    await traffic(target.url, args.rate, args.duration, tally, args.seed)
    stop.set()
    await watcher
    if kill_task is not None:
        await kill_task
    final, idle_state = await idle_sample(target, t0)

    slopes = {a: slope_per_min(samples, a) for a in ("fds", "rss_mib", "tasks")}
    deltas = {"fds": final.fds - baseline.fds, "tasks": final.tasks - baseline.tasks,
              "rss_ratio": final.rss_mib / baseline.rss_mib}
    report = {"duration_s": args.duration, "rate": args.rate, "sent": tally.sent,
              "skipped_client_saturated": tally.skipped, "outcomes": dict(tally.outcomes),
              "lost": tally.outcomes.get("LOST", 0), "lost_examples": tally.lost,
              "unexpected_examples": tally.unexpected, "kills": kills,
              "slopes_per_min": slopes, "idle_baseline": asdict(baseline),
              "idle_final": asdict(final), "idle_deltas": deltas, "idle_state": idle_state,
              "samples": [asdict(s) for s in samples]}
    print(f"sent {tally.sent} requests ({tally.skipped} skipped: client saturated)")
    for name, count in sorted(tally.outcomes.items()):
        print(f"  {name:32s} {count}")
    for line in tally.unexpected:
        print("  unexpected:", line)
    for line in kills:
        print("  kill:", line)
    print(f"idle after warm-up: fds {baseline.fds:g}, RSS {baseline.rss_mib:.1f} MiB, tasks "
          f"{baseline.tasks:g}")
    print(f"idle at the end:    fds {final.fds:g}, RSS {final.rss_mib:.1f} MiB, tasks "
          f"{final.tasks:g}; running {idle_state.get('running')}, free blocks "
          f"{idle_state.get('free_blocks')}/{idle_state.get('total_blocks')}")
    print(f"slopes under load, per minute ({len(samples)} samples): fds {slopes['fds']:+.3f}, "
          f"RSS {slopes['rss_mib']:+.3f} MiB, tasks {slopes['tasks']:+.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    failures = []
    if report["lost"]:
        failures.append(f"{report['lost']} requests lost: {tally.lost[:5]}")
    if idle_state.get("running") or idle_state.get("free_blocks") != idle_state.get(
            "total_blocks"):
        failures.append(f"not idle at the end: {idle_state}")
    if deltas["fds"] > args.max_fd_delta:
        failures.append(f"open fds grew by {deltas['fds']:g} between the idle samples")
    if deltas["tasks"] > args.max_task_delta:
        failures.append(f"asyncio tasks grew by {deltas['tasks']:g} between the idle samples")
    if deltas["rss_ratio"] > 1 + args.max_rss_growth:
        failures.append(f"RSS grew {deltas['rss_ratio'] - 1:.1%} between the idle samples")
    # Under load fds and tasks follow the requests in flight, so a slope is noise in a short
    # run; the limits apply from SLOPE_MIN_DURATION_S on.
    if args.duration >= SLOPE_MIN_DURATION_S:
        for name, limit in (("fds", args.max_fd_slope), ("rss_mib", args.max_rss_slope),
                            ("tasks", args.max_task_slope)):
            if not abs(slopes[name]) <= limit:  # nan fails too
                failures.append(f"{name} slope {slopes[name]:+.3f}/min over {limit:g}")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (open loop)")
    p.add_argument("--url", default=None, help="soak a running server instead of starting one "
                   "(it needs the tenants this script writes; see write_tenants)")
    p.add_argument("--fleet", type=int, default=0, help="start a local fleet of N fake "
                   "replicas behind a router instead of one server")
    p.add_argument("--kill-every", type=float, default=120.0, help="with --fleet: SIGKILL a "
                   "random replica this often (0: never)")
    p.add_argument("--decode-ms", type=float, default=10.0, help="fake model decode step")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of traffic before the "
                   "idle baseline")
    p.add_argument("--max-fd-delta", type=float, default=2, help="open fds, idle end - idle "
                   "baseline")
    p.add_argument("--max-task-delta", type=float, default=2, help="asyncio tasks, idle end - "
                   "idle baseline")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="RSS, idle end / idle "
                   "baseline - 1")
    p.add_argument("--max-fd-slope", type=float, default=0.5, help="open fds per minute under "
                   "load (runs of 10 min or more)")
    p.add_argument("--max-rss-slope", type=float, default=1.0, help="MiB per minute under load "
                   "(runs of 10 min or more)")
    p.add_argument("--max-task-slope", type=float, default=0.5, help="asyncio tasks per minute "
                   "under load (runs of 10 min or more)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write the report (with every sample) here")
    args = p.parse_args(argv)
    if args.url:
        return asyncio.run(soak(args, Target(args.url.rstrip("/"))))
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        target = start_target(args, Path(tmp))
        try:
            return asyncio.run(soak(args, target))
        finally:
            target.stop()
            log = target.log_path.read_text(errors="replace") if target.log_path else ""
            if "Traceback" in log:
                print("the server logged a traceback:\n" + log[-4000:])


if __name__ == "__main__":
    sys.exit(main())
