"""The size-or-timeout Batcher (flusher): throughput, latency and its own overhead.

Prints a markdown table and appends it to BENCHMARKS.md.

(a) synthetic model, 200 ms per batch of up to 100, open-loop Poisson arrivals: throughput, latency,
    rejections (the ceiling is 100 / 0.2 s = 500 requests/s);
(b) null model: items per second through `submit` (the batcher's own overhead);
(c) the bundled embedding model in-process: one call per sentence against a Batcher with concurrent
    callers (closed loop) and at a fixed arrival rate (open loop), in float32 and bfloat16.

    python -m scripts.bench flusher                 # full run (about 4 minutes)
    python -m scripts.bench flusher --duration 2 --parts a,b --no-append
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batcher.flusher.flusher import Batcher, Overloaded
from scripts.bench._shared import ROOT, command, parser

HEADER = (
    "| part | setting | offered /s | throughput /s | p50 ms | p99 ms | rejected "
    "| vs unbatched | machine | command |"
)


@dataclass(slots=True)
class Row:
    part: str
    setting: str
    offered: str
    throughput: float
    latencies: list[float]
    rejected: int = 0
    ratio: str = "—"

    def cells(self, machine: str, command: str) -> str:
        lat = sorted(self.latencies) or [float("nan")]
        p50 = lat[len(lat) // 2] * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        return (
            f"| {self.part} | {self.setting} | {self.offered} | {self.throughput:,.0f} "
            f"| {p50:.1f} | {p99:.1f} | {self.rejected} | {self.ratio} | {machine} | `{command}` |"
        )


async def open_loop(
    submit: Callable[[int], Awaitable[Any]], rate: float, duration: float, seed: int = 0
) -> tuple[float, list[float], int]:
    """Poisson arrivals at `rate`/s for `duration` s, never waiting for answers (open loop).

    Returns (steady throughput, latencies, rejections). Throughput counts answers that land inside
    the arrival window after a warm-up (the first quarter, at most 1 s), so neither the empty start
    nor the drain after the last arrival skews it.
    """
    rng = random.Random(seed)
    latencies: list[float] = []
    done_at: list[float] = []
    rejected = 0

    async def one(i: int) -> None:
        nonlocal rejected
        t0 = time.perf_counter()
        try:
            await submit(i)
        except Overloaded:
            rejected += 1
            return
        done_at.append(t1 := time.perf_counter())
        latencies.append(t1 - t0)

    tasks = []
    start = next_at = time.perf_counter()
    while (next_at := next_at + rng.expovariate(rate)) < start + duration:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(len(tasks))))
    await asyncio.gather(*tasks)
    warm = min(1.0, duration / 4)
    steady = sum(start + warm <= t <= start + duration for t in done_at)
    return steady / (duration - warm), latencies, rejected


async def closed_loop(
    submit: Callable[[Any], Awaitable[Any]], items: list[Any], callers: int, duration: float
) -> tuple[float, list[float]]:
    """`callers` tasks, each submitting the next item as soon as its last one is answered."""
    latencies: list[float] = []
    end = time.perf_counter() + duration

    async def caller(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await submit(items[i % len(items)])
            latencies.append(time.perf_counter() - t0)
            i += callers

    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return len(latencies) / (time.perf_counter() - start), latencies


async def part_a(rates: list[float], duration: float) -> list[Row]:
    def model(items: list[int]) -> list[int]:
        time.sleep(0.2)  # a fixed 200 ms per batch, whatever its size
        return items

    rows = []
    for rate in rates:
        async with Batcher(model, max_batch_size=100, max_wait_ms=20) as b:
            tput, lat, rej = await open_loop(b.submit, rate, duration)
        setting = f"200 ms/batch, batch 100, wait 20 ms, queue {b.max_queue}, {duration:g} s"
        rows.append(Row("a synthetic", setting, f"{rate:g}", tput, lat, rej))
    return rows


async def part_b(duration: float) -> list[Row]:
    def sync_null(items: list[int]) -> list[int]:
        return items

    async def async_null(items: list[int]) -> list[int]:
        return items

    rows = []
    for name, fn in (("sync fn (worker thread)", sync_null), ("async fn", async_null)):
        callers = 1000
        async with Batcher(fn, max_batch_size=100, max_wait_ms=1, max_queue=callers) as b:
            tput, lat = await closed_loop(b.submit, list(range(callers)), callers, duration)
        setting = f"null model, {name}, batch 100, {callers} callers"
        rows.append(Row("b overhead", setting, "closed", tput, lat))
    return rows


def corpus(n: int, seed: int = 0) -> list[str]:
    """Deterministic, varied English sentences of about 8-25 tokens."""
    rng = random.Random(seed)
    who = ["A man", "The old woman", "Two children", "Our neighbour", "A small dog", "The team"]
    did = ["is eating", "painted", "walked past", "is reading about", "bought", "talked about"]
    what = [
        "a piece of bread",
        "the red fence",
        "the quiet river",
        "a long history of ships",
        "the new phone",
        "yesterday's football match",
        "fresh vegetables at the market",
    ]
    tail = [
        "",
        " this morning",
        " after a long day at work",
        " because it was raining outside",
        " while the radio played softly in the kitchen",
    ]
    return [
        f"{rng.choice(who)} {rng.choice(did)} {rng.choice(what)}{rng.choice(tail)}."
        for _ in range(n)
    ]


async def part_c(
    dtypes: list[str], settings: list[tuple[int, float]], duration: float, rate: float
) -> list[Row]:
    from batcher.flusher.embeddings import EmbeddingModel, make_embedding_batcher

    texts = corpus(2000)
    rows = []
    for dtype in dtypes:
        model = EmbeddingModel(dtype=dtype)
        for size in (1, 2, 4, 8, 16, 32, 64, 100, 1, 32):  # first calls of each shape are slow
            model.embed(texts[:size])
        lat, i, end = [], 0, time.perf_counter() + duration
        start = time.perf_counter()
        while time.perf_counter() < end:  # the baseline: the same model, once per request
            t0 = time.perf_counter()
            model.embed([texts[i % len(texts)]])
            lat.append(time.perf_counter() - t0)
            i += 1
        base = len(lat) / (time.perf_counter() - start)
        rows.append(
            Row(
                "c embeddings",
                f"{dtype}, unbatched (1 call/sentence)",
                "closed",
                base,
                lat,
                ratio="1.00x",
            )
        )
        for size, wait in settings:
            callers = 2 * size
            async with make_embedding_batcher(model, size, wait, max_queue=callers) as b:
                tput, lat = await closed_loop(b.submit, texts, callers, duration)
            rows.append(
                Row(
                    "c embeddings",
                    f"{dtype}, batch {size}, wait {wait:g} ms, {callers} callers",
                    "closed",
                    tput,
                    lat,
                    ratio=f"{tput / base:.2f}x",
                )
            )
            async with make_embedding_batcher(model, size, wait) as b:
                tput, lat, rej = await open_loop(
                    lambda k: b.submit(texts[k % 2000]), rate, duration
                )
            rows.append(
                Row(
                    "c embeddings",
                    f"{dtype}, batch {size}, wait {wait:g} ms, queue {b.max_queue}",
                    f"{rate:g}",
                    tput,
                    lat,
                    rej,
                    ratio=f"{tput / base:.2f}x",
                )
            )
        del model
    return rows


def machine(load_before: float) -> str:
    name = platform.processor()
    if not name:
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            name = next(s.split(":", 1)[1].strip() for s in lines if s.startswith("model name"))
        except (OSError, StopIteration):
            name = platform.machine()
    # The load average says whether other work shared the CPUs during the run.
    return f"{name}, {os.cpu_count()} CPUs, load {load_before:.1f}-{os.getloadavg()[0]:.1f}"


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--parts", default="a,b,c", help="comma list of a, b, c")
    ap.add_argument("--rates", default="200,400,500,600", help="part a arrival rates (req/s)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="part c model dtypes")
    ap.add_argument(
        "--settings", default="8:2,32:5,100:20", help="part c max_batch_size:max_wait_ms pairs"
    )
    ap.add_argument("--rate", type=float, default=300.0, help="part c open-loop rate (req/s)")
    ap.add_argument("--no-append", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    if "a" in parts:
        rows += asyncio.run(part_a([float(r) for r in args.rates.split(",")], args.duration))
    if "b" in parts:
        rows += asyncio.run(part_b(args.duration))
    if "c" in parts:
        settings = [(int(s), float(w)) for s, w in (p.split(":") for p in args.settings.split(","))]
        rows += asyncio.run(part_c(args.dtypes.split(","), settings, args.duration, args.rate))
    cmd = command(__name__, *argv)
    sep = "|" + "---|" * HEADER.count(" | ") + "---|"
    where = machine(load_before)
    table = "\n".join([HEADER, sep, *(r.cells(where, cmd) for r in rows)])
    print(table)
    if not args.no_append:
        out = ROOT / "BENCHMARKS.md"
        head = "" if out.exists() else "# Benchmarks\n"
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        with out.open("a") as f:
            f.write(f"{head}\n## Batcher (scripts/bench/flusher.py), {stamp}\n\n{table}\n")

