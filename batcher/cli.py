"""`batcher serve | bench | fleet | router | sim | plan | batch`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

# Re-exported: the replica's flags, for the callers that still import them from here.
from batcher.serve_args import DEFAULT_SLO_TTFT_MS, add_serve_args

__all__ = ["DEFAULT_SLO_TTFT_MS", "add_serve_args", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batcher", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP"))
    from batcher.bench.cli import add_bench_args
    from batcher.fleet.cli import add_fleet_args, add_router_args
    from batcher.sim.cli import add_plan_args, add_sim_args

    add_bench_args(sub.add_parser("bench", help="load-test an OpenAI-compatible server"))
    add_fleet_args(sub.add_parser("fleet", help="N local replicas behind a router"))
    add_router_args(sub.add_parser("router", help="route over replicas anywhere"))
    add_plan_args(sub.add_parser("plan", help="capacity arithmetic: how many replicas"))
    add_sim_args(sub.add_parser("sim", help="simulate a fleet on a simulated clock"))
    from batcher.batch.offline import add_batch_args

    add_batch_args(sub.add_parser("batch", help="run a batch input file offline, in-process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from batcher.serve import run_server

        return _run(run_server(args))
    if args.command == "bench":
        from batcher.bench.cli import run_bench

        return run_bench(args)
    if args.command in ("fleet", "router"):
        from batcher.fleet.cli import run_fleet, run_router

        return _run(run_fleet(args) if args.command == "fleet" else run_router(args))
    if args.command == "plan":
        from batcher.sim.cli import run_plan

        return run_plan(args)
    if args.command == "sim":
        from batcher.sim.cli import run_sim

        return run_sim(args)
    if args.command == "batch":
        from batcher.batch.offline import run_offline

        return _run(run_offline(args))
    parser.error(f"unknown command {args.command}")
    return 2


def _run(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
