"""`batcher batch run FILE.jsonl`: a batch input file through the same engine, in-process, with no
server; every request's answer goes to one output file in OpenAI's batch output format, in input
order, and a progress line goes to stderr."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from batcher.batch.jsonl import InputLine, parse_input
from batcher.batch.lines import Deferred, LineResult, LineRunner, output_line
from batcher.batch.records import new_id
from batcher.http.errors import error_body
from batcher.admission.tenants import DEFAULT_TENANT

# A line refused for now this many times in a row is answered with the refusal: the engine is
# failing, not busy.
MAX_DEFERRALS = 50


def add_batch_args(p: argparse.ArgumentParser) -> None:
    from batcher.app.serve_flags import add_serve_args

    sub = p.add_subparsers(dest="batch_command", required=True)
    run = sub.add_parser("run", help="run a batch input file offline (no server)")
    run.add_argument("input", help="JSONL file of requests (OpenAI batch input format)")
    run.add_argument("-o", "--output", default=None, help="output JSONL (default: INPUT with "
                     "'.output.jsonl' in place of its suffix)")
    run.add_argument("--max-in-flight", type=int, default=None, help="requests in the engine "
                     "at once (default: the engine's --max-num-seqs)")
    add_serve_args(run)


class Progress:
    """One line, rewritten in place on a terminal; every 10% otherwise."""

    def __init__(self, total: int, out: TextIO = sys.stderr):
        self.total = total
        self.done = self.failed = 0
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self._shown = -1.0

    def add(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        step = 10 * self.done // self.total
        if self.done == self.total or (self.tty and now - self._shown >= 0.25) or (
                not self.tty and step > 10 * (self.done - 1) // self.total):
            self._shown = now
            self.show(now)

    def show(self, now: float) -> None:
        elapsed = max(1e-9, now - self.started)
        rate = self.done / elapsed
        width = 30
        filled = width * self.done // self.total
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"({self.failed} failed) {rate:.1f} req/s, {elapsed:.0f}s elapsed, "
                f"eta {eta:.0f}s")
        end = "\n" if self.done == self.total or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=self.out, flush=True)


async def run_lines(runner: LineRunner, lines: list[InputLine], max_in_flight: int,
                    progress: Progress) -> list[bytes]:
    """Each line's output-file line, in input order."""
    slots = asyncio.Semaphore(max_in_flight)
    outputs: list[bytes] = [b""] * len(lines)

    async def one(line: InputLine) -> None:
        async with slots:
            rid = new_id("batch_req_")
            for _ in range(MAX_DEFERRALS):
                try:
                    result = await runner.run(DEFAULT_TENANT, line.url, line.body, rid)
                    break
                except Deferred as d:
                    await asyncio.sleep(d.retry_after)
            else:
                result = LineResult(503, error_body(503, "the engine kept refusing this "
                                                    "request", code="engine_error"))
        outputs[line.index] = output_line(line.custom_id, result)
        progress.add(result.ok)

    await asyncio.gather(*(one(line) for line in lines))
    return outputs


def _join_model_thread(timeout: float = 10.0) -> None:
    """Wait for the engine's model thread to exit. The engine leaves it behind on stop (a wedged
    model must not block a server's exit), but a process that exits while that thread is still
    tearing down torch's thread state can abort ("terminate called without an active
    exception") instead of exiting with its status."""
    for t in threading.enumerate():
        if t.name == "batcher-model" and t is not threading.current_thread():
            t.join(timeout)


async def run_offline(args: argparse.Namespace) -> int:
    from batcher.admission.admission import Admission
    from batcher.engine.metrics import Metrics
    from batcher.app.serve import EMBEDDING_MODEL_NAME, build_embedder, build_engine, engine_model_name
    from batcher.server.auth import Authenticator
    from batcher.server.gateway import Gateway, GatewayConfig

    src = Path(args.input)
    try:
        data = src.read_bytes()
    except OSError as exc:
        print(f"batcher batch run: cannot read {src}: {exc.strerror}", file=sys.stderr)
        return 2
    lines, problems = parse_input(data, one_endpoint=False)
    if problems:
        for p in problems:
            where = f"line {p.line}: " if p.line else ""
            print(f"{src}: {where}{p.message} [{p.code}]", file=sys.stderr)
        return 2
    out_path = Path(args.output) if args.output else src.with_suffix(".output.jsonl")
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    engine = await loop.run_in_executor(None, build_engine, args, metrics)
    embedder, counter = None, None
    if any(line.url == "/v1/embeddings" for line in lines):
        embedder, counter = await loop.run_in_executor(None, build_embedder, args)
    in_flight = args.max_in_flight or engine.scheduler.config.max_num_seqs
    if in_flight < 1:
        print("batcher batch run: --max-in-flight must be >= 1", file=sys.stderr)
        return 2
    name = "fake" if args.model == "fake" else engine_model_name(args.model)
    gw = Gateway(GatewayConfig(model_name=args.served_model_name or name,
                               max_model_len=engine.scheduler.config.max_model_len,
                               default_max_tokens=args.default_max_tokens),
                 engine, Authenticator(None),
                 # No live traffic to protect: only the queue bound, sized to the lines in flight.
                 Admission(None, max_waiting=2 * in_flight, batch_share=1.0),
                 metrics, embedder, EMBEDDING_MODEL_NAME, counter)
    await engine.start()
    progress = Progress(len(lines))
    try:
        outputs = await run_lines(LineRunner(gw), lines, in_flight, progress)
    finally:
        if embedder is not None:
            await embedder.close()
        await engine.stop()
        await asyncio.to_thread(_join_model_thread)
    temp = out_path.with_name(out_path.name + ".tmp")
    temp.write_bytes(b"".join(o + b"\n" for o in outputs))
    temp.replace(out_path)
    print(f"batcher batch run: {progress.done - progress.failed} succeeded, {progress.failed} "
          f"failed; wrote {out_path}", file=sys.stderr)
    return 0 if progress.failed == 0 else 1
