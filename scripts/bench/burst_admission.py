"""Bursts at default flags on a fast device: how many requests admission lets in, their TTFT.

The device is the fake model at `--fake-decode-step-ms 3 --fake-prefill-rate 50000` (a step a
few milliseconds long, a GPU's scale rather than this CPU's), so the figures are admission's, not
the model's. Each server starts cold and takes, in turn: the chat64 workload (64 requests at
once), then 1,024 short requests at once (32-token prompts, 4 tokens each), then 1,024 longer
ones (200-token prompts, 64 tokens each: beyond what fits the 2 s SLO, so only the excess should
be refused). Every server answers at default flags apart from the fake model's speed.

`--base DIR` runs the same bursts against another checkout (e.g. a `git worktree` of an earlier
commit) in the same run, for a side-by-side row.

    python -m scripts.bench burst_admission [--base DIR] [--rounds 2] [--append]
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import aiohttp

from batcher.bench.common import append_rows, load_workload, pct, wait_until_up
from scripts.bench._shared import ROOT, parser, start_checkout

FAKE = ["--model", "fake", "--fake-decode-step-ms", "3", "--fake-prefill-rate", "50000",
        "--embedding-model", "none", "--host", "127.0.0.1"]
SLO_S = 2.0


async def _one(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
               ) -> tuple[int, float | None, str | None]:
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            reason = resp.headers.get("X-Reject-Reason")
            if reason is None:
                reason = ((await resp.json(content_type=None)) or {}).get(
                    "error", {}).get("code")
            return resp.status, None, reason
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
        return 200, first, None


async def burst(url: str, shapes: list[tuple[list[int], int]]) -> dict[str, object]:
    conn = aiohttp.TCPConnector(limit=0)  # the client must not cap its own connections
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        got = await asyncio.gather(*(_one(s, url, p, m) for p, m in shapes))
    ok = [f for st, f, _ in got if st == 200 and f is not None]
    reasons: dict[str, int] = {}
    for st, _, why in got:
        if st != 200:
            reasons[f"{st} {why}"] = reasons.get(f"{st} {why}", 0) + 1
    return {"sent": len(shapes), "ok": len(ok), "refused": reasons,
            "ttft_p50": pct(ok, 50), "ttft_p99": pct(ok, 99),
            "within_slo": sum(1 for f in ok if f <= SLO_S)}


def serve(checkout: Path, port: int) -> subprocess.Popen:
    return start_checkout(checkout, "serve", *FAKE, "--port", str(port),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)


def workloads() -> list[tuple[str, list[tuple[list[int], int]]]]:
    chat = [(r["prompt_ids"], r["max_new_tokens"]) for r in load_workload()]
    short = [([1000 + (i * 31 + j) % 30000 for j in range(32)], 4) for i in range(1024)]
    long = [([1000 + (i * 37 + j) % 30000 for j in range(200)], 64) for i in range(1024)]
    return [("chat64", chat), ("1,024 x (32 in, 4 out)", short),
            ("1,024 x (200 in, 64 out)", long)]


def run(label: str, checkout: Path, port: int) -> list[list[str]]:
    proc = serve(checkout, port)
    rows = []
    try:
        started = time.perf_counter()
        if not wait_until_up(f"http://127.0.0.1:{port}/ready", proc, 180):
            raise SystemExit(f"{label}: the server did not become ready")
        ready_s = time.perf_counter() - started
        for name, shapes in workloads():
            r = asyncio.run(burst(f"http://127.0.0.1:{port}", shapes))
            refused = ", ".join(f"{k}: {v}" for k, v in sorted(r["refused"].items())) or "0"
            rows.append([label, name, f"{ready_s:.1f}", f"{r['ok']}/{r['sent']}", refused,
                         f"{1000 * r['ttft_p50']:.0f} / {1000 * r['ttft_p99']:.0f}",
                         f"{r['within_slo']}"])
            time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def main(argv: list[str]) -> None:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--base", type=Path, help="another checkout to run side by side")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8741)
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args(argv)
    rows: list[list[str]] = []
    for _ in range(args.rounds):
        if args.base is not None:
            rows += run("before", args.base.resolve(), args.port)
        rows += run("this code", ROOT, args.port)
    header = ["server", "burst", "ready s", "answered", "refused", "TTFT p50 / p99 ms",
              f"first token <= {SLO_S:g} s"]
    table = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    print("| " + " | ".join(header) + " |\n" + table)
    if args.append:
        append_rows("Bursts at default flags on a fast device (fake model, 3 ms steps)",
                    header, rows, notes="Clients send every request of a burst at once and do "
                    "not retry; `refused` counts by status and reason (X-Reject-Reason).")

