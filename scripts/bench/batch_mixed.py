"""Interactive traffic with and without a batch beside it, on one `batcher serve` process.

    python -m scripts.bench batch_mixed [--lines 1000] [--rate-share 0.45] [--max-s 600]

Starts the bundled model at its default flags plus `--data-dir` (the batch API) and
`--slo-ttft-ms`, then runs `batcher bench`'s mixed run against it (`batcher/bench/mixed.py`:
capacity, interactive alone, interactive + a batch through /v1/batches, interactive + the same
lines sent live at priority batch, interactive alone again) and appends the table to
BENCHMARKS.md. Exit status 0 when the batch completed with interactive p99 TTFT within the SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from batcher.bench.client import ClientConfig
from batcher.bench.common import append_rows
from batcher.bench.mixed import HEADER, MixedConfig, report_rows, run_mixed
from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice
from scripts.bench._shared import ROOT, parser

MODEL = "smollm2-135m"


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen,
                     within: float = 240.0) -> None:
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
        await asyncio.sleep(0.5)
    raise SystemExit("the server was not ready in time")


async def main_async(args: argparse.Namespace) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tempfile.mkdtemp(prefix="batcher-bench-batch-")
    cmd = [sys.executable, "-m", "batcher.app.cli", "serve", "--model", MODEL, "--port", str(port),
           "--embedding-model", "none", "--log-level", "warning", "--data-dir", data,
           "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", *args.serve_arg]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)  # noqa: ASYNC220
    mc = MixedConfig(slo_ttft_s=args.slo_ttft_ms / 1000, lines=args.lines, rate=args.rate,
                     rate_share=args.rate_share, capacity_s=args.capacity_s,
                     alone_s=args.alone_s, max_s=args.max_s, contrast_s=args.contrast_s,
                     server_pid=proc.pid).validate()
    cfg = ClientConfig(url, MODEL, request_timeout=120)
    load = [os.getloadavg()[0]]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await wait_ready(session, url, proc)
            load.append(os.getloadavg()[0])
            rep = await run_mixed(session, cfg, mc)
            load.append(os.getloadavg()[0])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows, notes, ok = report_rows(rep, mc)
    notes += (f"\n- Server: `batcher serve --model {MODEL}` at its defaults plus --data-dir, "
              f"--slo-ttft-ms {args.slo_ttft_ms:g} {' '.join(args.serve_arg)}. Machine shared "
              f"with other work: load average {load[1]:.1f} at the start, {load[-1]:.1f} at the "
              f"end; the last column splits each phase's busy CPU cores into the server's and "
              f"everything else's (bench client included).")
    print(append_rows("Batch tier: interactive TTFT beside a batch on spare capacity", HEADER,
                      rows, notes, path=Path(args.out) if args.out else None))
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    p = parser(__name__, __doc__, first_paragraph=True)
    p.add_argument("--lines", type=int, default=1000, help="batch lines (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None, help="interactive requests/s (default: "
                   "--rate-share of the capacity measured first)")
    p.add_argument("--rate-share", type=float, default=0.45, help="(default: %(default)s)")
    p.add_argument("--capacity-s", type=float, default=30.0, help="(default: %(default)s)")
    p.add_argument("--alone-s", type=float, default=40.0, help="(default: %(default)s)")
    p.add_argument("--max-s", type=float, default=600.0, help="longest the batch phase runs "
                   "(default: %(default)s)")
    p.add_argument("--contrast-s", type=float, default=60.0, help="the live priority:batch "
                   "phase; 0: skip it (default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="(default: %(default)s)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `batcher serve` "
                   "argument (repeatable), e.g. --serve-arg=--batch-max-running=8")
    p.add_argument("--out", default=None, help="append the table here (default: BENCHMARKS.md)")
    return asyncio.run(main_async(p.parse_args(argv)))

