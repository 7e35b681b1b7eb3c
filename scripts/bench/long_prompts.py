"""Long-prompt (RAG-shaped) traffic on one replica at default flags, at 0.8 x its capacity.

Prompts drawn as the simulator's `--input-median 2000 --output-median 40` (lognormal, sigma 0.6,
prompts cut at 1,024 tokens), at 80% of the replica's measured capacity for this shape.

The capacity is measured first, on this checkout's `batcher serve` at its defaults: a closed loop
of `--depth` clients, each sending its next request as soon as its last one ends (when
refused, after the Retry-After it was given), for `--capacity-s` seconds; completions
per second after the first fifth. Then
each server (this checkout, and `--base DIR`, another checkout such as a `git worktree` of an
earlier commit, in the same run) gets the same open-loop arrivals at 0.8 x that rate for
`--duration` seconds, twice: Poisson, as one replica alone sees a Poisson stream, and spaced as
one replica's share of a Poisson stream sent round-robin over 32 replicas (the sum of 32
exponential gaps), which is what a replica of the simulator's 32-replica fleet sees. Goodput:
answered with a first token within the server's default TTFT SLO (2 s, also its goodput
threshold), as a share of the requests sent; refusals (503) count as misses.

`--fake` serves the fake model (the real server, scheduler, admission and HTTP path; only the
model step is a timed sleep) at this CPU's calibrated step costs with the CPU's slots and step
budget: a decode step of 24 ms plus 0.5 ms a stream, prefill at 1,380 tokens/s, so a 1,024-token
prompt alone takes ~0.84 s as on the bundled model (`workloads/step_time_cpu.json`). Its steps
do not slow down when other work shares the cores, which the bundled model's do.

    python -m scripts.bench long_prompts [--base DIR] [--fake] [--rounds N] [--duration 45]
        [--append]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import time
from pathlib import Path

import aiohttp

from batcher.bench.common import append_rows, pct, wait_until_up
from batcher.sim.workload import RequestGen, ShapeSpec
from scripts.bench._shared import ROOT, command, parser, start_checkout

SHAPE = ShapeSpec(input_median=2000, output_median=40)
SLO_S = 2.0  # batcher serve's default --slo-ttft-ms
LOAD = 0.8
FLEET = 32  # round-robin's share: one replica of this many
FAKE_CPU = ["--model", "fake", "--fake-prefill-rate", "1380", "--fake-decode-step-ms", "24",
            "--fake-per-seq-ms", "0.5", "--max-num-seqs", "64", "--max-num-batched-tokens", "320"]


def requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, max_tokens) of the shape; ids drawn from ordinary vocabulary, different
    per request so that no prefix is cached."""
    gen, rng = RequestGen(SHAPE, seed), random.Random(seed)
    return [(rng.choices(range(1000, 40000), k=p), o)
            for p, o, _ in (gen.lengths() for _ in range(n))]


MODEL: dict[str, str] = {}  # url -> the model name the server lists


async def one(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
              ) -> tuple[int, float | None, float | None, int]:
    """(status, TTFT s, TPOT s, tokens) of one streamed completion; for a refusal, TTFT is
    the Retry-After it carried."""
    if url not in MODEL:
        async with s.get(f"{url}/v1/models") as resp:
            MODEL[url] = (await resp.json())["data"][0]["id"]
    body = {"model": MODEL[url], "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, float(resp.headers.get("Retry-After", 1)), None, 0
        first = last = None
        n = 0
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"text"' in line:
                last = time.perf_counter() - t0
                first = last if first is None else first
                n += 1
        tpot = (last - first) / (n - 1) if n > 1 and first is not None else None
        return 200, first, tpot, n


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def capacity(url: str, depth: int, seconds: float) -> float:
    """Completions/s of a closed loop `depth` deep, after its first fifth."""
    work = requests(10_000, 1)
    ends: list[float] = []
    t0 = time.perf_counter()
    nxt = iter(work)

    async def client(s: aiohttp.ClientSession) -> None:
        while time.perf_counter() - t0 < seconds:
            prompt, out = next(nxt)
            status, retry_after, *_ = await one(s, url, prompt, out)
            if status == 200:
                ends.append(time.perf_counter() - t0)
            else:  # refused: back off as told (a retry storm would take the model's cores)
                await asyncio.sleep(retry_after)

    async with session() as s:
        await asyncio.gather(*(client(s) for _ in range(depth)))
    done = [t for t in ends if t >= seconds / 5]
    return len(done) / (seconds - seconds / 5)


def arrival_times(rate: float, duration: float, process: str, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        if process == "poisson":
            t += rng.expovariate(rate)
        else:  # one replica's share of round-robin over FLEET replicas
            t += sum(rng.expovariate(rate * FLEET) for _ in range(FLEET))
        if t >= duration:
            return out
        out.append(t)


async def open_loop(url: str, rate: float, duration: float, process: str) -> dict:
    times = arrival_times(rate, duration, process, 7)
    work = requests(len(times), 2)
    async with session() as s:
        t0 = time.perf_counter()

        async def at(t: float, prompt: list[int], out: int):
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            return await one(s, url, prompt, out)

        got = await asyncio.gather(*(at(t, p, o) for t, (p, o) in zip(times, work, strict=True)))
    ok = [g for g in got if g[0] == 200 and g[1] is not None]
    ttft = [g[1] for g in ok]
    tpot = [g[2] for g in ok if g[2] is not None]
    good = sum(1 for g in ok if g[1] <= SLO_S)
    return {"sent": len(got), "ok": len(ok), "refused": sum(1 for g in got if g[0] == 503),
            "goodput": good / len(got) if got else 0.0, "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "tpot_p99": pct(tpot, 99)}


def idle(url: str, timeout: float = 120.0) -> None:
    """Wait until the server runs and queues nothing (the capacity loop's last requests)."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/v1/state") as resp:
            state = json.load(resp)
        if state["running"] == 0 and state["waiting"] == 0:
            return
        time.sleep(0.5)


def serve(checkout: Path, port: int, fake: bool) -> subprocess.Popen:
    """`batcher serve` at its defaults (what ./scripts/serve starts), on `port`."""
    extra = FAKE_CPU if fake else []
    return start_checkout(checkout, "serve", "--port", str(port), *extra,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)


def run(label: str, checkout: Path, args: argparse.Namespace, rate: float | None
        ) -> tuple[float, list[list[str]]]:
    proc = serve(checkout, args.port, args.fake)
    url = f"http://127.0.0.1:{args.port}"
    MODEL.pop(url, None)
    rows = []
    try:
        if not wait_until_up(f"{url}/ready", proc, 300):
            raise SystemExit(f"{label}: the server did not become ready")
        if rate is None:
            cap = asyncio.run(capacity(url, args.depth, args.capacity_s))
            print(f"capacity ({label}): {cap:.3f} req/s", flush=True)
            rate = LOAD * cap
            idle(url)
        for process in ("poisson", "round-robin share"):
            r = asyncio.run(open_loop(url, rate, args.duration, process))
            print(label, process, r, flush=True)
            rows.append([label, process, f"{rate:.3f}", f"{r['ok']}/{r['sent']}",
                         str(r["refused"]), f"{r['goodput']:.1%}",
                         f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}",
                         f"{1000 * r['tpot_p99']:.0f}" if r["tpot_p99"] == r["tpot_p99"]
                         else "-"])
    finally:
        proc.terminate()
        proc.wait(30)
    return rate, rows


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--base", type=Path, help="another checkout to run side by side")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals")
    ap.add_argument("--capacity-s", type=float, default=40.0)
    ap.add_argument("--depth", type=int, default=8, help="closed-loop clients (capacity)")
    ap.add_argument("--rounds", type=int, default=1, help="servers taken in turn, this many "
                    "times (the capacity is measured once, in the first)")
    ap.add_argument("--port", type=int, default=8743)
    ap.add_argument("--fake", action="store_true", help="the fake model at this CPU's step costs")
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args(argv)
    rate: float | None = None
    rows: list[list[str]] = []
    for k in range(1, args.rounds + 1):
        tag = f" (round {k})" if args.rounds > 1 else ""
        rate, got = run("this code" + tag, ROOT, args, rate)
        rows += got
        if args.base is not None:
            rows += run("before" + tag, args.base.resolve(), args, rate)[1]
    assert rate is not None
    header = ["server", "arrivals", "req/s (0.8 x capacity)", "answered", "refused",
              f"goodput (TTFT <= {SLO_S:g} s)", "TTFT p50 / p99 s", "TPOT p99 ms"]
    print("| " + " | ".join(header) + " |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if args.append:
        cmd = command(__name__, *(["--base", "DIR"] if args.base else []),
                      *(["--fake"] if args.fake else []),
                      *(["--rounds", str(args.rounds)] if args.rounds > 1 else []),
                      "--duration", f"{args.duration:g}", "--append")
        model = "fake model at the CPU's step costs" if args.fake else "bundled model"
        append_rows("Long prompts (median 2,000 in, cut at 1,024; 40 out) at 0.8 x one replica's "
                    f"capacity, default flags, {model}", header, rows, command=cmd,
                    notes=f"Capacity measured on this code's server: {rate / LOAD:.3f} req/s "
                    f"(closed loop of {args.depth}, {args.capacity_s:g} s); both servers get "
                    "the same arrivals at 0.8 x it. DIR: a `git worktree` of the commit before "
                    "the first-token pacing change. Goodput counts refusals as misses.")

