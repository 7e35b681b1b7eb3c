"""Routing on a mixed fleet of real processes: `batcher fleet` with three fake-model replicas, one
slowed, loaded by `batcher bench` once per router policy (the default predicted wait, and
round-robin for comparison), in pairs whose order alternates so drift on a shared machine falls
on both. Writes one BENCHMARKS.md table: goodput and p99 TTFT of each run, and the ratios.

    python scripts/bench_routing_fleet.py                  # 2 pairs of 60 s runs at 5 req/s
    python scripts/bench_routing_fleet.py --pairs 1 --duration 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_common import ROOT, append_rows, pct
from batcher.fleet.launcher import free_port  # below the ephemeral range, never twice

POLICIES = ("predicted-wait", "round-robin")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"batcher fleet exited early (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} was not ready within {timeout:g} s")


def run_one(policy: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fleet = subprocess.Popen(
        [sys.executable, "-m", "batcher.cli", "fleet", "--replicas", "3", "--model", "fake",
         "--slow-replicas", f"1:{args.slowdown:g}", "--fake-decode-step-ms", "50",
         "--max-num-seqs", "8", "--policy", policy, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(url, fleet, 120.0)
        label = f"{policy}-{len(list(out.iterdir()))}"
        cmd = [sys.executable, "-m", "batcher.cli", "bench", "--base-url", url, "--synthetic",
               "--input-median", "256", "--output-median", "64", "--arrivals", "poisson",
               "--rate", f"{args.rate:g}", "--duration", f"{args.duration:g}", "--seed",
               str(args.seed), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200", "--no-plots",
               "--no-metrics", "--out", str(out / label), "--label", label]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       timeout=args.duration * 4 + 120)
        doc = json.loads((out / label / "report.json").read_text())
    finally:
        fleet.terminate()
        try:
            fleet.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fleet.kill()
            fleet.wait()
    s = doc["summary"]
    reqs = doc["requests"]
    return {"policy": policy, "sent": len(reqs), "ok": s["ok"],
            "refused": sum(1 for r in reqs if r.get("status") == 503),
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p99": s["tpot_ms"]["p99"], "goodput_rps": s["goodput_rps"],
            "goodput_share": s["goodput_share"]}


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="pairs of runs (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run "
                    "(default: %(default)s)")
    ap.add_argument("--rate", type=float, default=5.0, help="requests/s, about 80%% of the "
                    "fleet's capacity (default: %(default)s)")
    ap.add_argument("--slowdown", type=float, default=2.0, help="how much slower the slow "
                    "replica steps (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="workload seed (default: %(default)s)")
    ap.add_argument("--no-write", action="store_true", help="print, do not append")
    args = ap.parse_args()
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
    notes = (f"Three `batcher serve --model fake` replicas behind `batcher fleet`, one "
             f"{args.slowdown:g}x slower; {args.rate:g} req/s Poisson for {args.duration:g} s, "
             f"256-token prompts, 64-token answers (medians), streaming; goodput: TTFT <= 1 s "
             f"and TPOT <= 200 ms. Refused: the replicas' own 503s the router's retry budget "
             f"could not place. Load average {load_before:.1f} before, {load_after:.1f} after. "
             + "; ".join(ratios) + f". Predicted-wait goodput median {med:.0%}.")
    header = ["router policy", "sent", "ok", "503", "TTFT p50 / p99 ms", "TPOT p99 ms",
              "goodput /s (share)"]
    if args.no_write:
        print("\n".join(" | ".join(r) for r in rows) + "\n" + notes)
    else:
        print(append_rows("Routing on a mixed fleet: 3 fake replicas, one slowed, predicted "
                          "wait vs round-robin (scripts/bench_routing_fleet.py)",
                          header, rows, notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
