"""Routing on a mixed fleet of real processes: predicted wait vs round-robin, goodput and TTFT.

`batcher fleet` with three fake-model replicas, one slowed, loaded by `batcher bench` once per
router policy (the default predicted wait, and round-robin for comparison), in pairs whose order
alternates so drift on a shared machine falls on both. Writes one BENCHMARKS.md table: goodput and
p99 TTFT of each run, and the ratios.

    python -m scripts.bench routing_fleet                  # 2 pairs of 60 s runs at 5 req/s
    python -m scripts.bench routing_fleet --pairs 1 --duration 20
    python -m scripts.bench routing_fleet --bundled        # the bundled model, see below

--bundled: two `batcher serve` replicas of the bundled model at their defaults, one torch thread
each and each pinned to a core of its own, behind `batcher router`; the second replica's core
also runs a busy loop (a noisy neighbour: that replica gets about half a core). The replicas
start afresh for every run, so no run finds the prompts of another cached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from batcher.bench.common import append_rows, pct, wait_until_up
from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice
from scripts.bench._shared import ROOT, parser

POLICIES = ("predicted-wait", "round-robin")
BUNDLED_RATE = 1.5


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    if not wait_until_up(url + "/ready", proc, timeout):
        raise SystemExit(f"a process exited early (code {proc.returncode})"
                         if proc.poll() is not None else
                         f"{url} was not ready within {timeout:g} s")


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def bundled_fleet(policy: str, port: int, procs: list[subprocess.Popen]) -> None:
    """Two bundled-model replicas, one per core, the second's core shared with a busy loop, and
    a router, each added to `procs` as it starts (the caller stops them)."""
    if not shutil.which("taskset"):
        raise SystemExit("--bundled pins each replica to a core with taskset, which is missing")
    urls = []
    for core in (0, 1):
        rport = free_port()
        procs.append(start(["taskset", "-c", str(core), sys.executable, "-m", "batcher.app.cli",
                            "serve", "--host", "127.0.0.1", "--port", str(rport),
                            "--torch-threads", "1", "--embedding-model", "none"]))
        urls.append(f"http://127.0.0.1:{rport}")
    procs.append(start(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"]))
    for url, proc in zip(urls, procs):
        wait_ready(url, proc, 300.0)
    router = [sys.executable, "-m", "batcher.app.cli", "router", "--policy", policy,
              "--host", "127.0.0.1", "--port", str(port)]
    for url in urls:
        router += ["--replica", url]
    procs.append(start(router))


def run_one(policy: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    try:
        if args.bundled:
            bundled_fleet(policy, port, procs)
        else:
            procs.append(start([sys.executable, "-m", "batcher.app.cli", "fleet", "--replicas", "3",
                                "--model", "fake", "--slow-replicas", f"1:{args.slowdown:g}",
                                "--fake-decode-step-ms", "50", "--max-num-seqs", "8",
                                "--policy", policy, "--host", "127.0.0.1", "--port",
                                str(port)]))
        wait_ready(url, procs[-1], 120.0)
        label = f"{policy}-{len(list(out.iterdir()))}"
        cmd = [sys.executable, "-m", "batcher.app.cli", "bench", "--base-url", url, "--synthetic",
               "--input-median", str(args.input_median), "--output-median",
               str(args.output_median), "--arrivals", "poisson",
               "--rate", f"{args.rate:g}", "--duration", f"{args.duration:g}", "--seed",
               str(args.seed), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200", "--no-plots",
               "--no-metrics", "--out", str(out / label), "--label", label]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       timeout=args.duration * 4 + 120)
        doc = json.loads((out / label / "report.json").read_text())
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    s = doc["summary"]
    reqs = doc["requests"]
    return {"policy": policy, "sent": len(reqs), "ok": s["ok"],
            "refused": sum(1 for r in reqs if r.get("status") == 503),
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p99": s["tpot_ms"]["p99"], "goodput_rps": s["goodput_rps"],
            "goodput_share": s["goodput_share"]}


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main(argv: list[str]) -> int:
    ap = parser(__name__, __doc__, first_paragraph=True)
    ap.add_argument("--pairs", type=int, default=2, help="pairs of runs (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run "
                    "(default: %(default)s)")
    # NOTE: %% stays doubled for argparse, which formats help strings itself.
    ap.add_argument("--rate", type=float, default=None, help="requests/s, about 80%% of the "
                    f"fleet's capacity (default: 5, or {BUNDLED_RATE:g} with --bundled)")
    ap.add_argument("--bundled", action="store_true", help="two bundled-model replicas, the "
                    "second sharing its core with a busy loop, instead of three fake ones")
    ap.add_argument("--input-median", type=int, default=None, help="prompt tokens (default: "
                    "256, or 128 with --bundled)")
    ap.add_argument("--output-median", type=int, default=None, help="answer tokens (default: "
                    "64, or 32 with --bundled)")
    ap.add_argument("--slowdown", type=float, default=2.0, help="how much slower the slow "
                    "replica steps (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="workload seed (default: %(default)s)")
    ap.add_argument("--no-write", action="store_true", help="print, do not append")
    args = ap.parse_args(argv)
    if args.rate is None:
        args.rate = BUNDLED_RATE if args.bundled else 5.0
    if args.input_median is None:
        args.input_median = 128 if args.bundled else 256
    if args.output_median is None:
        args.output_median = 32 if args.bundled else 64
    out = Path(tempfile.mkdtemp(prefix="routing-fleet-"))
    load_before = os.getloadavg()[0]
    results = []
    try:
        for i in range(args.pairs):
            order = POLICIES if i % 2 == 0 else POLICIES[::-1]
            for policy in order:
                r = run_one(policy, args, out)
                r["pair"] = i + 1
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    load_after = os.getloadavg()[0]
    rows = [[f"{r['policy']} (pair {r['pair']})", str(r["sent"]), str(r["ok"]),
             str(r["refused"]), f"{fmt(r['ttft_p50'])} / {fmt(r['ttft_p99'])}",
             fmt(r["tpot_p99"], 1), f"{r['goodput_rps']:.2f} ({r['goodput_share']:.0%})"]
            for r in results]
    ratios = []
    for i in range(1, args.pairs + 1):
        pw, rr = (next(r for r in results if r["pair"] == i and r["policy"] == p)
                  for p in POLICIES)
        ratio = (pw["ttft_p99"] / rr["ttft_p99"]) if pw["ttft_p99"] and rr["ttft_p99"] else None
        ratios.append(f"pair {i}: goodput {100 * (pw['goodput_share'] - rr['goodput_share']):+.0f}"
                      f" points, p99 TTFT x{fmt(ratio, 2)} round-robin's")
    med = pct([r["goodput_share"] for r in results if r["policy"] == POLICIES[0]], 50)
    fleet = (("Two `batcher serve` replicas of the bundled model at their defaults, one torch "
              "thread each on a core of its own, behind `batcher router`, the second's core "
              "shared with a busy loop (half a core), both started afresh for each run")
             if args.bundled else
             (f"Three `batcher serve --model fake` replicas behind `batcher fleet`, one "
              f"{args.slowdown:g}x slower"))
    notes = (f"{fleet}; {args.rate:g} req/s Poisson for {args.duration:g} s, "
             f"{args.input_median}-token prompts, {args.output_median}-token answers (medians), "
             f"streaming; goodput: TTFT <= 1 s "
             f"and TPOT <= 200 ms. Refused: the replicas' own 503s the router's retry budget "
             f"could not place. Load average {load_before:.1f} before, {load_after:.1f} after. "
             + "; ".join(ratios) + f". Predicted-wait goodput median {med:.0%}.")
    header = ["router policy", "sent", "ok", "503", "TTFT p50 / p99 ms", "TPOT p99 ms",
              "goodput /s (share)"]
    if args.no_write:
        print("\n".join(" | ".join(r) for r in rows) + "\n" + notes)
    else:
        what = ("2 bundled-model replicas, one sharing its core" if args.bundled else
                "3 fake replicas, one slowed")
        print(append_rows(f"Routing on a mixed fleet: {what}, predicted "
                          "wait vs round-robin (scripts/bench/routing_fleet.py)",
                          header, rows, notes))
    return 0

