"""Interactive traffic with and without a batch running beside it, on one `batcher serve` process.

    python scripts/bench_batch_mixed.py [--lines 300] [--rate 1.0] [--alone-s 40] [--max-s 240]

Phase 1, interactive alone: streaming completions (about 100-token prompts, 32 tokens out)
arrive as a Poisson process at `--rate` for `--alone-s` seconds.
Phase 2, interactive + batch: a batch of `--lines` requests of the same shape is created through
`/v1/files` and `/v1/batches`, and the same Poisson traffic runs until the batch completes
(bounded by `--max-s`). Phase 3: interactive alone again, to show drift of a shared machine. The server runs the bundled model at its defaults plus `--data-dir` and
`--slo-ttft-ms`; batch lines run only on the capacity interactive traffic leaves.
Reported per phase: interactive TTFT p50 / p99 against the SLO, refusals, and (phase 2) the
batch's wall time, lines per second, and the server's spare-capacity token and deferral counters.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from batcher.bench.client import ClientConfig, RequestResult, send_request
from batcher.bench.common import append_rows, pct
from batcher.bench.workload import BenchRequest

MODEL = "smollm2-135m"
MAX_TOKENS = 32
WORDS = ("harbour", "lantern", "copper", "meadow", "violet", "engine", "orbit", "canyon",
         "pepper", "winter", "marble", "sailor", "thunder", "garden", "silver", "quartz",
         "falcon", "ribbon", "desert", "lemon", "island", "timber", "velvet", "comet")


def prompt(i: int) -> str:
    rng = random.Random(i)
    return f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(80)) + ". Summarise:"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen,
                     within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit("the server was not ready in time")


async def poisson(session: aiohttp.ClientSession, cfg: ClientConfig, rate: float, seed: int,
                  first_id: int, until: asyncio.Event | None, duration: float,
                  max_requests: int) -> list[RequestResult]:
    """Open-loop arrivals for `duration` seconds, or until `until` is set; bounded in count."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    at = rng.expovariate(rate)
    while at < duration and len(tasks) < max_requests and not (until and until.is_set()):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            if until is not None:
                try:
                    await asyncio.wait_for(until.wait(), delay)
                    break
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(delay)
        i = first_id + len(tasks)
        req = BenchRequest(f"live-{i}", None, prompt(i), MAX_TOKENS)
        tasks.append(asyncio.create_task(send_request(session, cfg, req, t0)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        m = re.match(r"(batcher_batch_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", ln)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def run_batch(session: aiohttp.ClientSession, url: str, lines: int, done: asyncio.Event,
                    max_s: float) -> tuple[float, dict]:
    items = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": prompt(100_000 + i), "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "temperature": 0}} for i in range(lines)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"".join(orjson.dumps(x) + b"\n" for x in items),
                   filename="mixed.jsonl")
    async with session.post(url + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    start = time.perf_counter()
    async with session.post(url + "/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/completions",
            "completion_window": "24h"}) as r:
        batch = await r.json()
    try:
        while time.perf_counter() - start < max_s:
            async with session.get(url + f"/v1/batches/{batch['id']}") as r:
                batch = await r.json()
            if batch["status"] not in ("validating", "in_progress", "finalizing"):
                break
            await asyncio.sleep(0.5)
    finally:
        done.set()
    return time.perf_counter() - start, batch


def summary(results: list[RequestResult], slo_s: float) -> dict:
    ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
    return {"sent": len(results), "ok": sum(r.ok for r in results),
            "refused": sum(r.status in (429, 503) for r in results),
            "p50": pct(ttft, 50), "p99": pct(ttft, 99),
            "within": sum(t <= slo_s for t in ttft)}


async def main_async(args: argparse.Namespace) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tempfile.mkdtemp(prefix="batcher-bench-batch-")
    cmd = [sys.executable, "-m", "batcher.cli", "serve", "--model", MODEL, "--port", str(port),
           "--embedding-model", "none", "--log-level", "warning", "--data-dir", data,
           "--slo-ttft-ms", f"{args.slo_ttft_ms:g}"]
    proc = start(cmd)
    slo = args.slo_ttft_ms / 1000
    cfg = ClientConfig(url, MODEL, prompt_mode="text", request_timeout=120)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await wait_ready(session, url, proc)
            load_before = os.getloadavg()[0]
            await poisson(session, cfg, 2.0, 99, 900_000, None, 3.0, 6)  # warm-up
            alone = summary(await poisson(session, cfg, args.rate, 1, 0, None, args.alone_s,
                                          int(3 * args.rate * args.alone_s) + 1), slo)
            done = asyncio.Event()
            batch_task = asyncio.create_task(run_batch(session, url, args.lines, done,
                                                       args.max_s))
            mixed_results = await poisson(session, cfg, args.rate, 1, 10_000, done, args.max_s,
                                          int(3 * args.rate * args.max_s) + 1)
            wall, batch = await batch_task
            mixed = summary(mixed_results, slo)
            m = await metrics(session, url)
            if batch["status"] in ("validating", "in_progress"):
                # Not done within --max-s: cancel it, so the last phase is really alone.
                async with session.post(url + f"/v1/batches/{batch['id']}/cancel") as r:
                    await r.read()
            # Alone again: how much of any difference is the shared machine drifting.
            after = summary(await poisson(session, cfg, args.rate, 2, 20_000, None, args.alone_s,
                                          int(3 * args.rate * args.alone_s) + 1), slo)
            load_after = os.getloadavg()[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    counts = batch["request_counts"]
    tokens = m.get("batcher_batch_spare_capacity_tokens_total", 0.0)
    deferrals = sum(v for k, v in m.items() if k.startswith("batcher_batch_deferrals_total"))
    yields = m.get('batcher_batch_deferrals_total{reason="yield"}', 0.0)
    sheds = m.get('batcher_batch_deferrals_total{reason="shed"}', 0.0)
    rows = []
    for name, s in (("interactive alone (before)", alone), ("interactive + batch", mixed),
                    ("interactive alone (after)", after)):
        rows.append([name, str(s["sent"]), str(s["ok"]), str(s["refused"]),
                     f"{s['p50'] * 1000:,.0f}", f"{s['p99'] * 1000:,.0f}",
                     f"{s['within']}/{s['ok']}",
                     "" if s is not mixed else f"{batch['status']} {counts['completed']}/"
                     f"{counts['total']} in {wall:.0f} s ({counts['completed'] / wall:.2f}/s)",
                     "" if s is not mixed else f"{tokens:,.0f}"])
    ok = mixed["p99"] <= slo and batch["status"] == "completed"
    notes = (f"- Interactive: Poisson {args.rate:g}/s, ~100-token prompts, {MAX_TOKENS} tokens "
             f"out, streamed; TTFT SLO {args.slo_ttft_ms:g} ms. Batch: {args.lines} lines of the "
             f"same shape (sized to finish in a few minutes on this CPU, not 1,000). The server "
             f"ran the bundled model at its defaults; batch line starts put off "
             f"{deferrals:.0f} times ({yields:.0f} lines in prefill made way for queued "
             f"interactive requests, {sheds:.0f} running lines shed; the rest admission "
             f"refusals).\n"
             f"- Interactive p99 TTFT within the SLO while the batch completed: "
             f"{'yes' if ok else 'NO'} (p99 {mixed['p99'] * 1000:,.0f} ms with the batch vs "
             f"{alone['p99'] * 1000:,.0f} / {after['p99'] * 1000:,.0f} ms alone before / "
             f"after).\n"
             f"- Machine shared with other work: load average {load_before:.1f} before, "
             f"{load_after:.1f} after.")
    print(append_rows("Batch tier: interactive TTFT with a batch on spare capacity",
                      ["phase", "sent", "ok", "refused", "TTFT p50 ms", "TTFT p99 ms",
                       "within SLO", "batch", "spare-capacity tokens"], rows, notes,
                      path=Path(args.out) if args.out else None))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=300)
    p.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    p.add_argument("--alone-s", type=float, default=40.0)
    p.add_argument("--max-s", type=float, default=240.0, help="longest the mixed phase runs")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--out", default=None, help="append the table here (default: BENCHMARKS.md)")
    args = p.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
