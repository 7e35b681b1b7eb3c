"""`batcher bench` against a real tiny-model server, and its pure parts (workloads, arrivals,
metrics parsing, sweep capacity, plots) on their own."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from batcher.bench import cli, sweep
from batcher.bench.arrivals import Arrivals, drive
from batcher.bench.plots import plot_goodput
from batcher.bench.report import _bucket_quantile, parse_metrics
from batcher.bench.workload import synthetic, take
from batcher.fleet.launcher import free_port
from batcher.server.auth import hash_key

PNG = b"\x89PNG\r\n\x1a\n"
RICH_KEY, POOR_KEY = "bench-rich-key", "bench-poor-key"


def _free_port() -> int:
    return free_port("127.0.0.1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A tiny-model server with two tenants: one unlimited in practice, one with a bucket so small
    that a handful of requests at once must get 429."""
    d = tmp_path_factory.mktemp("bench_server")
    tenants = d / "tenants.toml"
    tenants.write_text(
        f'[tenants.rich]\nkeys_sha256 = ["{hash_key(RICH_KEY)}"]\n'
        "tokens_per_minute = 100000000\nmax_concurrent = 1000\n\n"
        f'[tenants.poor]\nkeys_sha256 = ["{hash_key(POOR_KEY)}"]\n'
        "tokens_per_minute = 1\nburst = 64\nmax_concurrent = 1000\n")
    port = _free_port()
    log = (d / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batcher.app.cli", "serve", "--model", "tiny", "--num-blocks", "256",
         "--embedding-model", "none", "--host", "127.0.0.1", "--port", str(port),
         "--tenants", str(tenants), "--log-level", "warning",
         # The report's counts are under test, not admission: a machine slowed by its
         # neighbours while the server calibrates must not turn requests into 503s.
         "--slo-ttft-ms", "0"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {(d / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server not ready in 90 s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _run(argv: list[str]) -> int:
    return cli.main(argv)


def test_run_report_counts_timings_and_plots(server: tuple[str, int], tmp_path: Path) -> None:
    url, pid = server
    out = tmp_path / "run"
    rc = _run(["--base-url", url, "--server-pid", str(pid), "--api-key", RICH_KEY, "--synthetic", "--num-requests", "24",
               "--input-median", "40", "--output-median", "12", "--max-output", "24",
               "--arrivals", "poisson", "--rate", "40", "--metrics-interval", "0.1",
               "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    s, reqs = doc["summary"], doc["requests"]
    assert s["sent"] == len(reqs) == 24
    assert s["sent"] == s["ok"] + s["errors"]
    assert s["ok"] == 24 and s["errors_by_kind"] == {}, [r["error"] for r in reqs if r["error"]]
    assert s["length_mismatches"] == 0 and s["tokens_from_usage"] == 24
    for r in reqs:
        assert r["ttft"] is not None and 0 < r["ttft"] <= r["e2e"]
        assert r["output_tokens"] == r["max_tokens"]
        assert len(r["itl"]) <= r["output_tokens"] - 1
    # Generous SLOs: every request is goodput.
    assert s["goodput_requests"] == 24 and s["goodput_share"] == 1.0
    assert s["output_tok_s"] > 0 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    server_view = doc["server"]
    assert server_view is not None and server_view["queue_wait"]["count"] == 24
    assert server_view["kv_blocks_total"] == 256
    for name in ("cdf.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    assert "| run |" in (out / "report.md").read_text()
    if sys.platform == "linux":  # the CPU split reads /proc
        cpu = doc["cpu"]
        assert cpu["server"] > 0 and cpu["machine"] >= cpu["background"] >= 0


def test_forced_429_is_counted(server: tuple[str, int], tmp_path: Path) -> None:
    # Each request costs about 8 + 8 tokens against a bucket of 64 that refills at 1 token/min:
    # a few are admitted, the rest must be refused with 429.
    out = tmp_path / "poor"
    rc = _run(["--base-url", server[0], "--api-key", POOR_KEY, "--synthetic", "--num-requests", "12",
               "--input-median", "8", "--input-spread", "0", "--output-median", "8",
               "--output-spread", "0", "--warmup", "0", "--no-plots", "--no-metrics",
               "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    s = doc["summary"]
    assert s["sent"] == 12 == s["ok"] + s["errors"]
    assert 1 <= s["ok"] <= 4
    assert s["errors_by_kind"] == {"429": 12 - s["ok"]}
    refused = [r for r in doc["requests"] if r["kind"] == "429"]
    assert all(r["retry_after"] for r in refused)
    assert s["goodput_share"] == s["ok"] / 12


def test_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there
    assert _run(["--base-url", f"http://127.0.0.1:{port}", "--num-requests", "1",
                 "--out", str(tmp_path)]) == 1


# ---- pure parts ------------------------------------------------------------------------------

def test_synthetic_workload_is_seeded_and_shaped() -> None:
    make = functools.partial(synthetic, 400, input_median=200, input_spread=0.6,
                             output_median=50, output_spread=0.4, shared_prefix_tokens=32)
    a, b, c = make(seed=7), make(seed=7), make(seed=8)
    assert a == b and a != c
    ins = sorted(r.prompt_len for r in a)
    outs = sorted(r.max_tokens for r in a)
    assert 160 <= ins[200] <= 250 and 40 <= outs[200] <= 62  # medians near the asked ones
    prefix = a[0].prompt_ids[:32]
    assert all(r.prompt_ids[:32] == prefix for r in a)
    assert len({tuple(r.prompt_ids) for r in a}) == 400
    assert len({r.id for r in (take(a, i) for i in range(800))}) == 800


def test_arrival_schedules_are_bounded() -> None:
    poisson = Arrivals("poisson", num_requests=1000, duration=2.0, rate=50, seed=1).offsets()
    assert poisson == Arrivals("poisson", num_requests=1000, duration=2.0, rate=50,
                               seed=1).offsets()
    assert 60 < len(poisson) < 150 and poisson[-1] < 2.0
    assert Arrivals("burst", num_requests=10, burst_size=4, burst_interval=0.5).offsets() == [
        0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert Arrivals("all", num_requests=3).offsets() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        Arrivals("poisson", rate=1.0)  # neither a count nor a duration

    in_flight = peak = 0

    async def send(i: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return i

    got = asyncio.run(drive(Arrivals("closed", num_requests=20, concurrency=3), send))
    assert got == list(range(20)) and peak == 3


def test_sweep_capacity_is_the_last_rate_before_the_first_miss(tmp_path: Path) -> None:
    def p(rate: float, share: float) -> dict:
        return {"rate": rate, "goodput_share": share, "goodput_rps": rate * share,
                "request_throughput": rate}

    points = [p(4, 0.95), p(1, 1.0), p(2, 0.97), p(8, 0.6), p(16, 0.93)]
    assert sweep.capacity(points) == 4  # 16 passing after 8 missed does not count
    assert sweep.capacity([p(1, 0.89)]) is None
    assert sweep.capacity([p(1, 0.9), p(2, 0.9)]) == 2
    assert sweep.parse_rates("4, 1,2,2") == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError):
        sweep.parse_rates("0,1")
    png = plot_goodput(sorted(points, key=lambda x: x["rate"]), 4, tmp_path / "g.png")
    assert png.read_bytes()[:8] == PNG


def test_sweep_stops_after_consecutive_misses() -> None:
    tried: list[float] = []

    async def one(rate: float) -> dict:
        tried.append(rate)
        share = 1.0 if rate <= 2 else 0.5
        return {"goodput_share": share, "goodput_rps": rate * share, "request_throughput": rate,
                "output_tok_s": 1.0, "sent": 10, "ok": 10, "errors": 0,
                "ttft_ms": {"p50": 1.0, "p99": 2.0}, "tpot_ms": {"p50": 1.0, "p99": 2.0}}

    points = asyncio.run(sweep.sweep([1, 2, 3, 4, 5, 6], one))
    assert tried == [1, 2, 3, 4] and sweep.capacity(points) == 2


def test_metrics_parsing_and_histogram_quantiles() -> None:
    text = ("# TYPE batcher_kv_blocks_used gauge\nbatcher_kv_blocks_used 12.0\n"
            "# TYPE batcher_queue_wait_seconds histogram\n"
            'batcher_queue_wait_seconds_bucket{le="0.1"} 2.0\n'
            'batcher_queue_wait_seconds_bucket{le="1.0"} 4.0\n'
            'batcher_queue_wait_seconds_bucket{le="+Inf"} 4.0\n'
            "batcher_queue_wait_seconds_count 4.0\nbatcher_queue_wait_seconds_sum 1.2\n"
            "# TYPE other_metric gauge\nother_metric 3.0\n")
    m = parse_metrics(text)
    assert m["batcher_kv_blocks_used"] == 12.0 and "other_metric" not in m
    assert m["batcher_queue_wait_seconds_count"] == 4.0
    buckets = sorted((float(k.split("le=")[1][:-1]), v) for k, v in m.items() if "_bucket" in k)
    assert _bucket_quantile(buckets, 4, 0.5) == pytest.approx(0.1)
    assert _bucket_quantile(buckets, 4, 0.75) == pytest.approx(0.55)
