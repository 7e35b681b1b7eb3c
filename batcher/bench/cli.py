"""`batcher bench`: load an OpenAI-compatible server and report what a user would see.

    batcher bench --base-url http://127.0.0.1:8000 --workload workloads/chat64.json
    batcher bench --synthetic --arrivals poisson --rate 2 --duration 60 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 100
    batcher bench --synthetic --num-requests 100 --sweep-rates 0.5,1,2,4 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 100

(`python -m batcher.bench.cli` takes the same arguments.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from batcher.bench import sweep
from batcher.bench.arrivals import KINDS, Arrivals, drive
from batcher.bench.client import ENDPOINTS, ClientConfig, RequestResult, first_model, send_request
from batcher.bench.common import DEFAULT_WORKLOAD, append_rows
from batcher.bench.load import CpuMeter, CpuUse, wait_quiet
from batcher.bench.report import (
    TABLE_HEADER,
    MetricsScraper,
    markdown_table,
    phase_lines,
    refusal_lines,
    server_lines,
    summarize,
    table_row,
)
from batcher.bench.workload import BenchRequest, from_file, synthetic, take


def add_bench_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or router to "
                   "load (default: %(default)s)")
    s.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions (prompt as token ids or text) or chat (text) "
                   "(default: %(default)s)")
    s.add_argument("--model", default=None, help="model name (default: the first listed)")
    s.add_argument("--api-key", default=None, help="bearer key (default: env BATCHER_API_KEY "
                   "or OPENAI_API_KEY)")
    s.add_argument("--prompt-mode", choices=["ids", "text"], default="ids",
                   help="completions prompts as token ids or text (default: %(default)s)")
    s.add_argument("--no-ignore-eos", action="store_true", help="let answers stop at EOS (the "
                   "length check then reports short answers)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent "
                   "with every request (default: %(default)s)")
    s.add_argument("--priority", default=None, help="priority class to send, e.g. batch")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take (default: %(default)s)")
    s.add_argument("--retries", type=int, default=0, help="honour Retry-After as real "
                   "clients do: send a request refused with 429 or 503 again, after the wait "
                   "its Retry-After names, up to this many times (OpenAI's clients: 2); the "
                   "report says the time spent waiting (default: %(default)s: every refusal "
                   "counts)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=None, help="workload file (default: chat64)")
    w.add_argument("--synthetic", action="store_true", help="lognormal synthetic requests")
    w.add_argument("--input-median", type=float, default=256, help="synthetic prompt length "
                   "median, tokens (default: %(default)s)")
    w.add_argument("--input-spread", type=float, default=0.5, help="lognormal sigma "
                   "(default: %(default)s)")
    w.add_argument("--output-median", type=float, default=128, help="synthetic output length "
                   "median, tokens (default: %(default)s)")
    w.add_argument("--output-spread", type=float, default=0.5, help="lognormal sigma of the "
                   "output length (default: %(default)s)")
    w.add_argument("--max-input", type=int, default=4096, help="synthetic prompt length cap, "
                   "tokens (default: %(default)s)")
    w.add_argument("--max-output", type=int, default=2048, help="synthetic output length cap, "
                   "tokens (default: %(default)s)")
    w.add_argument("--shared-prefix-tokens", type=int, default=0, help="a system prompt of "
                   "this many tokens shared by every request (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="workload and arrivals seed "
                   "(default: %(default)s)")
    a = p.add_argument_group("arrivals (every run is bounded by a count, a duration or both)")
    a.add_argument("--arrivals", choices=KINDS, default="all", help="all: every request at "
                   "t=0; poisson: --rate per second; burst: --burst-size every --burst-interval; "
                   "closed: --concurrency users (default: %(default)s)")
    a.add_argument("--num-requests", type=int, default=None, help="(default: the workload's "
                   "size, or unbounded with --duration)")
    a.add_argument("--duration", type=float, default=None, help="stop sending after this many "
                   "seconds")
    a.add_argument("--rate", type=float, default=1.0, help="Poisson requests/s "
                   "(default: %(default)s)")
    a.add_argument("--burst-size", type=int, default=8, help="requests per burst "
                   "(default: %(default)s)")
    a.add_argument("--burst-interval", type=float, default=1.0, help="seconds between bursts "
                   "(default: %(default)s)")
    a.add_argument("--concurrency", type=int, default=8, help="closed-loop users "
                   "(default: %(default)s)")
    a.add_argument("--sweep-rates", default=None, help="comma-separated Poisson rates: one run "
                   "each, the goodput curve and capacity")
    x = p.add_argument_group("mixed run: interactive Poisson traffic beside a batch submitted "
                             "through /v1/files and /v1/batches (batcher/bench/mixed.py)")
    x.add_argument("--batch-lines", type=int, default=None, metavar="N", help="run the mixed "
                   "benchmark with a batch of N lines (e.g. 1000); the TTFT SLO is "
                   "--slo-ttft-ms (default 2000 here)")
    x.add_argument("--batch-rate-share", type=float, default=0.45, help="interactive rate as "
                   "a share of the capacity measured first (default: %(default)s)")
    x.add_argument("--batch-interactive-rate", type=float, default=None, help="interactive "
                   "requests/s instead (skips the capacity phase)")
    x.add_argument("--batch-alone-s", type=float, default=40.0, help="seconds of interactive "
                   "traffic alone, before and after (default: %(default)s)")
    x.add_argument("--batch-max-s", type=float, default=600.0, help="longest the batch phase "
                   "runs; an unfinished batch is then cancelled (default: %(default)s)")
    x.add_argument("--batch-contrast-s", type=float, default=60.0, help="seconds of the "
                   "contrast phase (the lines sent live at priority batch); 0 skips it "
                   "(default: %(default)s)")
    m = p.add_argument_group("measurement and output")
    m.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    m.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    m.add_argument("--warmup", type=int, default=1, help="short requests sent first, not "
                   "measured (default: %(default)s)")
    m.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between "
                   "/metrics scrapes (default: %(default)s)")
    m.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    m.add_argument("--out", default=None, help="output folder (default: bench_out/<time>)")
    m.add_argument("--label", default=None, help="name of this run in tables")
    m.add_argument("--no-plots", action="store_true", help="write no PNG plots (no "
                   "matplotlib needed)")
    m.add_argument("--server-pid", type=int, default=None, help="the server's process id, to "
                   "split the CPU time of a run into server, client and background")
    m.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each measured run, wait up to this long for an idle machine "
                   "(default: do not wait)")
    m.add_argument("--append-benchmarks", default=None, metavar="TITLE",
                   help="append the result table to BENCHMARKS.md under this title")


def command() -> str:
    """How this run was started, for BENCHMARKS.md (`batcher bench` or the module form)."""
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    return "batcher bench " + shlex.join(argv)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments describe; 0 when any request succeeded."""
    try:
        return asyncio.run(_main(args))
    except ValueError as exc:
        print(f"batcher bench: {exc}", file=sys.stderr)
        return 2


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.synthetic:
        return synthetic(args.num_requests or 64, input_median=args.input_median,
                         input_spread=args.input_spread, output_median=args.output_median,
                         output_spread=args.output_spread, max_input=args.max_input,
                         max_output=args.max_output,
                         shared_prefix_tokens=args.shared_prefix_tokens, seed=args.seed)
    return from_file(args.workload or DEFAULT_WORKLOAD)


def build_arrivals(args: argparse.Namespace, n_workload: int, kind: str | None = None,
                   rate: float | None = None) -> Arrivals:
    count = args.num_requests
    if count is None and args.duration is None:
        count = n_workload
    return Arrivals(kind=kind or args.arrivals, num_requests=count, duration=args.duration,
                    rate=rate if rate is not None else args.rate, burst_size=args.burst_size,
                    burst_interval=args.burst_interval, concurrency=args.concurrency,
                    seed=args.seed)


async def run_once(session: aiohttp.ClientSession, cfg: ClientConfig,
                   workload: list[BenchRequest], arr: Arrivals, metrics_interval: float,
                   server_pid: int | None = None
                   ) -> tuple[list[RequestResult], dict[str, Any] | None, CpuUse | None]:
    """One measured run: requests on the arrival pattern, /metrics scraped alongside, the
    machine's CPU use split into server, client and background."""
    meter = CpuMeter(server_pid)
    meter.start()
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    scraper = MetricsScraper(session, cfg.base_url, metrics_interval, t0, headers) \
        if metrics_interval > 0 else None
    if scraper is not None:
        await scraper.start()

    async def send(i: int) -> RequestResult:
        return await send_request(session, cfg, take(workload, i), t0)

    results = await drive(arr, send)
    cpu = meter.stop()
    if scraper is None:
        return results, None, cpu
    await scraper.stop()
    return results, scraper.summary(), cpu


async def settle(args: argparse.Namespace) -> None:
    if args.wait_quiet > 0 and await wait_quiet(args.wait_quiet) is None:
        print(f"batcher bench: the machine was not idle within {args.wait_quiet:g} s; "
              "running anyway (the report shows the background CPU use)", file=sys.stderr)


async def warm_up(session: aiohttp.ClientSession, cfg: ClientConfig,
                  workload: list[BenchRequest], n: int) -> None:
    # Short answers: enough to take lazy start-up costs out of the measured run.
    for i in range(n):
        r = workload[i % len(workload)]
        await send_request(session, cfg, BenchRequest(f"warmup-{i}", r.prompt_ids,
                                                      r.prompt_text, 4), time.perf_counter())


def write_run(out: Path, label: str, args: argparse.Namespace, arr: Arrivals,
              results: list[RequestResult], server: dict[str, Any] | None,
              summary: dict[str, Any], cpu: CpuUse | None, plot: bool) -> str:
    out.mkdir(parents=True, exist_ok=True)
    reqs = [r.to_json() for r in results]
    doc = {"label": label, "arrivals": arr.describe(), "base_url": args.base_url,
           "endpoint": args.endpoint, "summary": summary, "server": server,
           "cpu": None if cpu is None else asdict(cpu), "requests": reqs}
    (out / "report.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = markdown_table([table_row(label, summary)]) + "\n" + "\n".join(
        f"- {line}" for line in server_lines(server) + phase_lines(summary)
        + refusal_lines(summary)) + "\n"
    if cpu is not None:
        text += f"- {cpu.describe()}\n"
    if summary["length_mismatches"]:
        text += (f"- {summary['length_mismatches']} answers not of the asked length, e.g. "
                 f"{summary['mismatched'][:3]}\n")
    (out / "report.md").write_text(f"# {label}\n\n{arr.describe()}\n\n{text}")
    if plot:
        # matplotlib is imported only to plot: `batcher serve` builds this parser too and
        # would otherwise hold it (about 30 MiB) for its whole life.
        from batcher.bench import plots

        plots.plot_cdfs({label: reqs}, out / "cdf.png", summary["slo_ttft_ms"],
                        summary["slo_tpot_ms"])
        plots.plot_timeline(reqs, server, out / "timeline.png", label)
    return text


async def _main(args: argparse.Namespace) -> int:
    workload = build_workload(args)
    out = Path(args.out or Path("bench_out") / time.strftime("%Y%m%d-%H%M%S"))
    api_key = args.api_key or os.environ.get("BATCHER_API_KEY") or os.environ.get(
        "OPENAI_API_KEY")
    connector = aiohttp.TCPConnector(limit=0)  # every open-loop request gets its connection
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        try:
            model = args.model or await first_model(session, args.base_url, api_key)
        except (aiohttp.ClientError, ConnectionError, KeyError, IndexError) as exc:
            print(f"batcher bench: cannot list models at {args.base_url}: {exc}",
                  file=sys.stderr)
            return 1
        cfg = ClientConfig(args.base_url, model, args.endpoint, api_key,
                           not args.no_ignore_eos, args.temperature, args.priority,
                           args.prompt_mode, args.request_timeout, args.retries)
        if args.batch_lines is not None:
            return await _mixed(args, session, cfg)
        await warm_up(session, cfg, workload, args.warmup)
        interval = 0.0 if args.no_metrics else args.metrics_interval
        if args.sweep_rates:
            return await _sweep(args, session, cfg, workload, interval, out)
        arr = build_arrivals(args, len(workload))
        # A server may name its model by file path: the file name is enough in a table.
        label = args.label or f"{model.rsplit('/', 1)[-1]}, {arr.describe()}"
        await settle(args)
        results, server, cpu = await run_once(session, cfg, workload, arr, interval,
                                              args.server_pid)
    summary = summarize(results, args.slo_ttft_ms, args.slo_tpot_ms)
    text = write_run(out, label, args, arr, results, server, summary, cpu, not args.no_plots)
    print(text + f"\nreport: {out}/report.json, report.md" +
          ("" if args.no_plots else ", cdf.png, timeline.png"))
    if args.append_benchmarks:
        append_rows(args.append_benchmarks, TABLE_HEADER, [table_row(label, summary)],
                    "\n".join(f"- {line}" for line in server_lines(server)
                              + ([cpu.describe()] if cpu else [])), command())
    return 0 if summary["ok"] else 1


async def _mixed(args: argparse.Namespace, session: aiohttp.ClientSession,
                 cfg: ClientConfig) -> int:
    from batcher.bench.mixed import HEADER, MixedConfig, report_rows, run_mixed

    mc = MixedConfig(slo_ttft_s=(args.slo_ttft_ms or 2000.0) / 1000, lines=args.batch_lines,
                     rate=args.batch_interactive_rate, rate_share=args.batch_rate_share,
                     alone_s=args.batch_alone_s, max_s=args.batch_max_s,
                     contrast_s=args.batch_contrast_s, server_pid=args.server_pid,
                     seed=args.seed + 1).validate()
    rep = await run_mixed(session, cfg, mc)
    rows, notes, ok = report_rows(rep, mc)
    print(markdown_table(rows, HEADER) + "\n" + notes)
    if args.append_benchmarks:
        append_rows(args.append_benchmarks, HEADER, rows, notes, command())
    return 0 if ok else 1


async def _sweep(args: argparse.Namespace, session: aiohttp.ClientSession, cfg: ClientConfig,
                 workload: list[BenchRequest], interval: float, out: Path) -> int:
    rows: list[list[str]] = []

    async def one(rate: float) -> dict[str, Any]:
        arr = build_arrivals(args, len(workload), "poisson", rate)
        label = f"{args.label or cfg.model} @ {rate:g}/s"
        await settle(args)
        results, server, cpu = await run_once(session, cfg, workload, arr, interval,
                                              args.server_pid)
        summary = summarize(results, args.slo_ttft_ms, args.slo_tpot_ms)
        write_run(out / f"rate-{rate:g}", label, args, arr, results, server, summary, cpu,
                  not args.no_plots)
        rows.append(table_row(label, summary))
        print(markdown_table([rows[-1]]), flush=True)
        return summary

    points = await sweep.sweep(sweep.parse_rates(args.sweep_rates), one)
    cap = sweep.capacity(points)
    doc = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
           "target_share": sweep.TARGET_SHARE, "capacity_rps": cap, "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    verdict = (f"goodput capacity: {cap:g} requests/s (highest rate with >= "
               f"{sweep.TARGET_SHARE:.0%} of requests within SLO)" if cap is not None else
               "goodput capacity: below the lowest rate tried")
    (out / "sweep.md").write_text(markdown_table(rows) + "\n" + verdict + "\n")
    if not args.no_plots:
        from batcher.bench import plots

        plots.plot_goodput(points, cap, out / "goodput_vs_rate.png")
    print(verdict + f"\nsweep: {out}/sweep.json, sweep.md")
    if args.append_benchmarks:
        append_rows(args.append_benchmarks, TABLE_HEADER, rows, verdict, command())
    return 0 if any(p["ok"] for p in points) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batcher bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
