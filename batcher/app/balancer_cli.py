"""`batcher balancer` (a global balancer over running cells) and `batcher fleet --cells C` (C local
cells of `--replicas` replicas each, behind one balancer on `--port`).

A local cell is a `batcher fleet --cells 1` child process: its own router, registry and replicas,
on loopback ports; its replicas die with it. The balancer probes cells with a key generated for
the run (each cell's fleet key), and no cell address is ever public.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from batcher.fleet.balancer.policy import BalancerConfig
from batcher.fleet.router.context import RouterConfig
from batcher.fleet.router.policy import PolicyConfig
from batcher.fleet.router.retry_flags import add_retry_health_args, health_config, retry_settings


def add_cell_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cells")
    a = g.add_argument
    a("--shift-at", type=float, default=0.8, help="a tenant leaves its home cell when the "
      "cell's saturation (0-1) reaches this (default: %(default)s)")
    a("--shed-at", type=float, default=0.95, help="with every cell at or past this "
      "saturation, new requests get 503 + Retry-After (default: %(default)s)")


def add_balancer_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--cell", action="append", default=[], metavar="URL", required=True,
      help="a cell's router to balance over (repeatable)")
    a("--cell-key", default=None, help="the cells' admin or fleet key, for their deep probes "
      "(or env BATCHER_CELL_KEY); without it cells are judged by liveness and state")
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    a("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    a("--admin-port", type=int, default=None, help="admin listener port (drain a cell); off "
      "unless given")
    a("--admin-host", default="127.0.0.1", help="admin listener address "
      "(default: %(default)s)")
    a("--admin-key", default=None, help="balancer admin key (or env BATCHER_ADMIN_KEY)")
    a("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get "
      "to finish on SIGTERM (default: %(default)s)")
    a("--log-level", default="info", type=str.lower,
      choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    add_retry_health_args(p.add_argument_group("retries and health"))
    add_cell_policy_args(p)


def balancer_configs(args: argparse.Namespace, cell_key: str | None
                     ) -> tuple[RouterConfig, BalancerConfig]:
    cfg = RouterConfig(
        # The relay's affinity key carries the tenant scope; with no minimum length every
        # well-formed request has one, and the balancer uses only its tenant part.
        policy=PolicyConfig(affinity_min_chars=0, affinity_chars=1),
        health=health_config(args), **retry_settings(args), replica_admin_key=cell_key)
    try:
        bcfg = BalancerConfig(shift_at=args.shift_at, shed_at=args.shed_at).validate()
    except ValueError as exc:
        raise SystemExit(f"--shift-at/--shed-at: {exc}") from None
    return cfg, bcfg


async def run_balancer(args: argparse.Namespace) -> int:
    from batcher.fleet.balancer.app import BalancerContext, serve_balancer
    from batcher.fleet.launcher import wait_for_signal
    from batcher.system.gc_freeze import freeze_startup_heap

    cfg, bcfg = balancer_configs(args, args.cell_key or os.environ.get("BATCHER_CELL_KEY"))
    ctx = BalancerContext(cfg, bcfg)
    for url in args.cell:
        ctx.registry.add_static(url)
    freeze_startup_heap()
    close = await serve_balancer(ctx, args.host, args.port, args.admin_port, args.admin_host,
                                 args.admin_key or os.environ.get("BATCHER_ADMIN_KEY"),
                                 args.shutdown_timeout)
    print(f"batcher: balancing on http://{args.host}:{args.port} over {len(args.cell)} cells",
          flush=True)
    try:
        await wait_for_signal()
    finally:
        await close()
    return 0


async def run_cells(args: argparse.Namespace, flags: list[str]) -> int:
    """`batcher fleet --cells C`: C child fleets, one balancer in front. `flags`: the `batcher
    serve` flags every replica gets (`fleet.cli.serve_flags`)."""
    from batcher.fleet.balancer.app import BalancerContext, serve_balancer
    from batcher.fleet.launcher import ReplicaSpec, Supervisor, free_port, wait_for_signal

    key = secrets.token_hex(16)
    # The fleet's own retry and health flags are the balancer's too.
    cfg, bcfg = balancer_configs(args, key)
    ctx = BalancerContext(cfg, bcfg)
    specs = []
    for i in range(args.cells):
        port = free_port()
        argv = [sys.executable, "-m", "batcher.app.cli", "fleet", *flags,
                "--cells", "1", "--replicas", str(args.replicas), "--port", str(port),
                "--log-level", args.log_level, "--max-attempts", str(args.max_attempts)]
        if args.restart:
            argv.append("--restart")
        specs.append(ReplicaSpec(f"c{i}", f"http://127.0.0.1:{port}", None, argv))
        ctx.registry.add_static(specs[-1].url, specs[-1].replica_id)
    # Each cell's fleet key (its replicas' heartbeats) is also the key its deep probe takes.
    sup = Supervisor(specs, {"BATCHER_FLEET_KEY": key}, restart=args.restart)
    ctx.processes = sup.status
    close = await serve_balancer(ctx, args.host, args.port, args.admin_port, args.admin_host,
                                 args.admin_key or os.environ.get("BATCHER_ADMIN_KEY"),
                                 args.shutdown_timeout)
    await sup.start()
    print(f"batcher: {args.cells} cells of {args.replicas} replicas behind "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await sup.stop(args.shutdown_timeout + 5)
        await close()
    return 0
