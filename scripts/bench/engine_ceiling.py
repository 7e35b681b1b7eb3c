"""The engine loop's own ceiling: `--model fake` at zero cost, so what remains is the host.

    python -m scripts.bench engine_ceiling [--streams 1,64,256] [--rounds 2]
        [--checkout base=../base-checkout] [--append-benchmarks TITLE]

Each run starts a fresh server on 127.0.0.1 whose model costs nothing (`--fake-decode-step-ms 0
--fake-per-seq-ms 0 --fake-prefill-rate inf`), sends N streaming completions of 128-token
prompts and 256-token answers all at t=0 to it cold (no warm-up request; admission's TTFT
check off, `--slo-ttft-ms 0`), and reports what the
client saw and what the server did: streamed tokens per second at the client (counted from each
stream's `usage`, not from its chunks, which may carry several tokens), time per output token,
first token p50 / p99, mean and most streams running, the host's time per step (wall time over
the steps the engine took, and the server's CPU time over them: on a shared machine the second
is the steadier; over the whole run, and over the steps while every stream was running), the
server's CPU, and the connections the host dropped for a full accept queue (a client whose SYN
is dropped tries again a second later).

`--checkout LABEL=DIR` runs the server of another checkout (e.g. a `git worktree` of an older
commit) with this interpreter, interleaved with this one in every round, so rows of the same
run compare. A server without `--fake-per-seq-ms` gets the closest it has: `--fake-step-factor
1e-6`, and the device defaults the fake model takes today spelt out as flags.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from batcher.bench.client import ClientConfig, RequestResult, send_request
from batcher.bench.common import append_rows, pct, wait_until_up
from batcher.bench.load import CpuMeter, process_cpu_seconds
from batcher.bench.workload import synthetic
from batcher.http.listener import run_event_loop
from scripts.bench._shared import ROOT, cli_module, parser, start_checkout

# Admission's time-to-first-token check predicts from a step-time prior fitted to a real model,
# which a model that costs nothing does not follow: off, as for any throughput ceiling.
SERVER_FLAGS = ["--slo-ttft-ms", "0"]
ZERO_COST = ["--fake-decode-step-ms", "0", "--fake-per-seq-ms", "0",
             "--fake-prefill-rate", "inf"]
# For a server that predates --fake-per-seq-ms: steps a millionth of their default cost, and
# the sequences, tokens and blocks per step the fake model now takes by default.
OLD_FAKE = ["--fake-step-factor", "0.000001", "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192", "--num-blocks", "16384"]
HEADER = ["code", "streams", "ok", "streamed tok/s", "TPOT p50 / p99 ms",
          "first token p50 / p99 ms", "streams running mean / max", "host ms / step",
          "server CPU ms / step", "host / CPU ms a step, all running", "server CPU",
          "client CPU", "SYNs dropped", "length ok"]


def listen_overflows() -> int | None:
    """Connections this host's listeners dropped since boot for a full accept queue (Linux):
    a client that connects while the queue is full retries its SYN a second later."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row["ListenOverflows"]) if "ListenOverflows" in row else None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def supports_per_seq(path: str) -> bool:
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-m", cli_module(Path(path)), "serve", "--help"],
                         env=env, cwd=path, capture_output=True, text=True, check=True).stdout
    return "--fake-per-seq-ms" in out


class Server:
    """One `batcher serve --model fake` at zero cost, from the checkout at `path`."""

    def __init__(self, path: str, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ZERO_COST if supports_per_seq(path) else OLD_FAKE
        self.args = ["serve", "--model", "fake", "--port", str(self.port),
                     "--embedding-model", "none", "--log-level", "warning", *SERVER_FLAGS,
                     *flags, *extra]
        self.proc = start_checkout(Path(path), *self.args, stdout=subprocess.DEVNULL)

    def __enter__(self) -> Server:
        if not wait_until_up(self.url + "/ready", self.proc, 120.0):
            self.proc.kill()
            raise RuntimeError(f"the server did not start: batcher {' '.join(self.args)}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def state(self) -> dict:
        with urllib.request.urlopen(self.url + "/v1/state", timeout=5) as resp:
            return orjson.loads(resp.read())


@dataclass(slots=True, frozen=True)
class Sample:
    """The server's state at one moment of a run: when, how many running, its step count, its
    CPU seconds (None where /proc cannot be read)."""

    at: float
    running: int
    steps: int
    cpu: float | None


async def watch_running(session: aiohttp.ClientSession, url: str, pid: int | None,
                        out: list[Sample], interval: float = 0.05) -> None:
    while True:
        async with session.get(url + "/v1/state") as resp:
            state = await resp.json(content_type=None)
        out.append(Sample(time.perf_counter(), int(state["running"]), int(state["steps"]),
                          process_cpu_seconds(pid) if pid is not None else None))
        await asyncio.sleep(interval)


def all_running(samples: list[Sample], n: int) -> str:
    """Host and server CPU ms a step while all `n` streams ran: wall time and CPU time over the
    steps between the first and the last sample that saw `n` running (the steady state, without
    the burst's intake before it and the streams' ends after it); "—" with fewer than two."""
    full = [s for s in samples if s.running >= n]
    if len(full) < 2 or full[-1].steps <= full[0].steps:
        return "—"
    first, last = full[0], full[-1]
    steps = last.steps - first.steps
    host = (last.at - first.at) / steps * 1000
    if first.cpu is None or last.cpu is None:
        return f"{host:.2f} / —"
    return f"{host:.2f} / {(last.cpu - first.cpu) / steps * 1000:.2f}"


async def load(url: str, n: int, prompt: int, answer: int, pid: int | None = None
               ) -> tuple[list[RequestResult], float, list[Sample]]:
    work = synthetic(n, input_median=prompt, input_spread=0.0, output_median=answer,
                     output_spread=0.0, max_input=prompt, max_output=answer)
    # NOTE: no connection cap: aiohttp's default connector allows 100 at once.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        cfg = ClientConfig(url, "fake", request_timeout=300.0)
        running: list[Sample] = []
        watcher = asyncio.create_task(watch_running(session, url, pid, running))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(send_request(session, cfg, r, t0) for r in work))
        wall = time.perf_counter() - t0
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return list(results), wall, running


def run_one(label: str, path: str, n: int, args: argparse.Namespace) -> list[str]:
    with Server(path, args.server_arg) as server:
        before, overflows = server.state(), listen_overflows()
        meter = CpuMeter(server.proc.pid)
        meter.start()
        results, wall, samples = run_event_loop(load(server.url, n, args.prompt, args.answer,
                                               server.proc.pid))
        cpu = meter.stop()
        after = server.state()
        dropped = None if overflows is None else (listen_overflows() or 0) - overflows
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    steps = after["steps"] - before["steps"]
    tpot = [t * 1000 for r in ok if (t := r.tpot) is not None]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    length_ok = sum(r.length_ok for r in ok)
    errors = sorted({r.error or r.kind for r in results if not r.ok})
    if errors:
        print(f"{label} x{n}: errors {errors[:3]}", file=sys.stderr)
    return [label, str(n), f"{len(ok)}/{n}", f"{tokens / wall:,.0f}",
            f"{pct(tpot, 50):.2f} / {pct(tpot, 99):.2f}",
            f"{pct(ttft, 50):,.0f} / {pct(ttft, 99):,.0f}",
            f"{tokens / steps if steps else 0:.1f} / "
            f"{max((x.running for x in samples), default=0)}",
            f"{wall / steps * 1000 if steps else float('nan'):.2f}",
            "—" if cpu is None or cpu.server is None or not steps else
            f"{cpu.server * cpu.seconds / steps * 1000:.2f}", all_running(samples, n),
            "—" if cpu is None or cpu.server is None else f"{cpu.server:.2f}",
            "—" if cpu is None else f"{cpu.client:.2f}", "—" if dropped is None else str(dropped),
            f"{length_ok}/{len(ok)}"]


def _median_cell(cells: list[str]) -> str:
    """The median of one column's cells over rounds ("a / b" part by part; text as is)."""
    parts = [c.split(" / ") for c in cells]
    if len({len(p) for p in parts}) != 1:
        return cells[0]
    out = []
    for k in range(len(parts[0])):
        texts = [p[k] for p in parts]
        try:
            values = sorted(float(t.replace(",", "")) for t in texts)
        except ValueError:
            return cells[0]
        mid = values[len(values) // 2]
        digits = len(texts[0].partition(".")[2])
        out.append(f"{mid:,.{digits}f}" if "," in texts[0] or mid >= 1000 else f"{mid:.{digits}f}")
    return " / ".join(out)


def medians(rows: list[list[str]]) -> list[list[str]]:
    """One row per (code, streams): the median of each column over the rounds."""
    groups: dict[tuple[str, str], list[list[str]]] = {}
    for r in rows:
        groups.setdefault((r[0], r[1]), []).append(r)
    out = []
    for (code, n), rs in groups.items():
        cells = [_median_cell([r[c] for r in rs]) for c in range(2, len(rs[0]))]
        out.append([f"{code} (median of {len(rs)})", n, *cells])
    return sorted(out, key=lambda r: (int(r[1]), r[0]))


def main(argv: list[str]) -> int:
    p = parser(__name__, __doc__, raw=True)
    p.add_argument("--streams", default="1,64,256", help="requests sent at t=0 per run, "
                   "comma-separated (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default: "
                   "%(default)s)")
    p.add_argument("--answer", type=int, default=256, help="answer tokens (default: "
                   "%(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="times every run is repeated, "
                   "interleaved (default: %(default)s)")
    p.add_argument("--label", default="this checkout", help="this checkout's name in the table")
    p.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                   help="also run the server of the checkout in DIR (repeatable)")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for every server (repeatable; e.g. "
                   "--server-arg=--slo-ttft-ms=0)")
    p.add_argument("--append-benchmarks", default=None, metavar="TITLE",
                   help="append the table to BENCHMARKS.md under this title")
    args = p.parse_args(argv)
    codes = [(args.label, str(ROOT))]
    for spec in args.checkout:
        label, _, path = spec.partition("=")
        if not path:
            p.error("--checkout takes LABEL=DIR")
        codes.append((label, str(Path(path).resolve())))
    streams = [int(x) for x in args.streams.split(",") if x]
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER), flush=True)
    rows = []
    for _ in range(args.rounds):
        for n in streams:
            for label, path in codes:
                rows.append(run_one(label, path, n, args))
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
    if args.rounds > 1:
        rows = medians(rows) + rows
        print("\n| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER))
        print("\n".join("| " + " | ".join(r) + " |" for r in rows[:len(rows) // (args.rounds + 1)]))
    if args.append_benchmarks:
        notes = ("- the first rows are the medians over the rounds, then every round in order; "
                 "each row a fresh server, cold (no warm-up request), all requests at t=0; "
                 f"{args.prompt}-token prompts, {args.answer}-token answers, streamed with "
                 "usage; tok/s counts the usage's tokens over the client's wall time; host ms "
                 "/ step is that wall time over the engine's steps, server CPU ms / step the "
                 "server's CPU time over them (both with the burst's intake and the streams' "
                 "ends); host / CPU ms a step, all running: the same over the steps while every "
                 "stream ran (sampled every 50 ms from /v1/state and the server's /proc); CPU in "
                 "cores; SYNs dropped: connections the "
                 "host's listeners dropped during the run for a full accept queue (each waits "
                 "a second for its retry)")
        append_rows(args.append_benchmarks, HEADER, rows, notes)
    return 0

