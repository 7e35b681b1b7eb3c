"""`batcher router` and `batcher fleet`: argument builders and the coroutines that run them.

Hooks for `batcher/app/cli.py`: `add_router_args(parser)` / `add_fleet_args(parser)` fill a
subparser; `await run_router(args)` / `await run_fleet(args)` run until SIGTERM or SIGINT and
return an exit code. `python -m batcher.app.fleet_cli router|fleet ...` runs them standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from batcher.flags.types import port
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.discovery import Discovery, HttpProber, Source, parse_source
from batcher.fleet.router.policy import POLICIES, PolicyConfig
from batcher.fleet.router.registry import Registry
from batcher.fleet.router.retry_flags import add_retry_health_args, health_config, retry_settings

if TYPE_CHECKING:
    from batcher.fleet.launcher import ReplicaSpec

log = logging.getLogger("batcher.fleet")

# `batcher serve` flags the fleet launcher sets itself for each replica.
_OWN_FLAGS = frozenset({"host", "port", "admin_port", "admin_host", "admin_key", "router",
                        "advertise_url", "replica_id", "version", "log_level", "help"})


def _policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing, retries and health")
    a = g.add_argument
    a("--policy", default="predicted-wait", choices=list(POLICIES), help="predicted-wait: the "
      "replica with the least predicted time to first token; round-robin: in turn, for "
      "comparison (default: %(default)s)")
    a("--affinity-chars", type=int, default=256, help="leading prompt characters hashed for "
      "prefix affinity; 0 turns it off (default: %(default)s)")
    a("--hot-headroom", type=float, default=0.1, help="KV is scarce below this share free "
      "after the request: it then adds to the predicted wait (default: %(default)s)")
    a("--affinity-max-extra-ms", type=float, default=50.0, help="predicted extra wait prefix "
      "affinity may cost at most (default: %(default)s)")
    a("--routing-slo-ttft-ms", type=float, default=1000.0, help="first-token objective the policy "
      "routes for: a request predicted to miss it on every replica is packed onto a replica "
      "too slow for it, keeping the others' queues short; 0 turns this off "
      "(default: %(default)s)")
    a("--late-extra-ms", type=float, default=10000.0, help="predicted extra wait such a request "
      "may get at most (default: %(default)s)")
    add_retry_health_args(g)
    a("--stream-idle-timeout", type=float, default=60.0, help="seconds without an upstream "
      "byte that end a stream attempt (default: %(default)s)")
    a("--fleet-key", default=None, help="key replicas must send with heartbeats (or env "
      "BATCHER_FLEET_KEY; prefer --fleet-key-file: a flag shows in the process list)")
    a("--fleet-key-file", default=None, metavar="PATH", help="read the fleet key from this file")
    a("--internal-port", type=int, default=None, help="the internal listener: replicas' "
      "heartbeats (`batcher serve --router http://HOST:PORT`); off unless given")
    a("--internal-host", default="127.0.0.1", help="address of the internal listener; off "
      "loopback it needs a fleet key, generated and printed when none is given "
      "(default: %(default)s)")
    a("--max-replicas", type=int, default=256, help="replicas one router registers at most "
      "(default: %(default)s)")
    a("--batch-pool", action="append", default=[], metavar="REPLICA_ID", help="a replica that "
      "takes the batch API's uploads, and so their batches (repeatable); default: the replica "
      "with the most headroom at each upload")


def add_router_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--replica", action="append", default=[], metavar="URL[,ADMIN_URL]",
      help="a replica to route to (repeatable); replicas may also join by heartbeating")
    a("--discover", action="append", default=[], type=_source, metavar="SPEC",
      help="where to find replicas (repeatable): static:URL,URL | file:PATH (one URL per "
      "line, re-read when it changes) | dns:NAME:PORT (every A/AAAA record, re-resolved; a "
      "headless Service). New addresses join after a first good probe; gone ones drain")
    a("--discover-interval", type=float, default=None, help="seconds between polls of every "
      "--discover source (default: 5 for dns, 1 for file)")
    a("--discover-drain-timeout", type=float, default=600.0, help="longest a vanished "
      "address keeps the router's in-flight work before it is forgotten "
      "(default: %(default)s)")
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    a("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    a("--admin-port", type=int, default=None, help="admin listener port (drain, canary); "
      "off unless given")
    a("--admin-host", default="127.0.0.1", help="admin listener address "
      "(default: %(default)s)")
    a("--admin-key", default=None, help="router admin key (or env BATCHER_ADMIN_KEY)")
    a("--replica-admin-key", default=None, help="key of the replicas' admin listeners (or env "
      "BATCHER_REPLICA_ADMIN_KEY)")
    a("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get "
      "to finish on SIGTERM (default: %(default)s)")
    a("--log-level", default="info", type=str.lower,
      choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    _policy_args(p)


def _source(spec: str) -> Source:
    try:
        return parse_source(spec)
    except ValueError as exc:  # argparse shows this message, not a bare "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """`batcher serve`'s flags (passed on to every replica; --host/--port/--admin-* are the
    router's) plus the fleet's own."""
    from batcher.app.serve_flags import add_serve_args

    add_serve_args(p)
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=2, help="replica processes "
                   "(default: %(default)s)")
    g.add_argument("--restart", action="store_true", help="restart replicas that exit")
    g.add_argument("--replica-base-port", type=port, default=None, metavar="PORT",
                   help="replica i listens on PORT + 2i and its admin listener on PORT + 2i + 1 "
                   "(default: free ports from 20000 up to the kernel's ephemeral range)")
    g.add_argument("--versions", default=None, help="comma-separated version labels given to "
                   "the replicas in turn (default: --deployment-version for all)")
    g.add_argument("--slow-replicas", default=None, metavar="K:F", help="with --model fake: "
                   "the first K replicas step F times slower (a mixed fleet)")
    g.add_argument("--cells", type=int, default=1, help="cells, each its own router over "
                   "--replicas replicas, behind one balancer on --port (default: %(default)s)")
    _policy_args(p)
    from batcher.app.balancer_cli import add_cell_policy_args

    add_cell_policy_args(p)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        policy=PolicyConfig(affinity_chars=args.affinity_chars, hot_headroom=args.hot_headroom,
                            affinity_max_extra_s=args.affinity_max_extra_ms / 1e3,
                            slo_ttft_s=args.routing_slo_ttft_ms / 1e3,
                            late_extra_s=args.late_extra_ms / 1e3),
        routing=args.policy,
        health=health_config(args), **retry_settings(args),
        stream_idle_timeout=args.stream_idle_timeout,
        max_body_bytes=getattr(args, "max_body_bytes", 4 * 2**20),
        fleet_key=fleet_key(args), max_replicas=args.max_replicas,
        batch_pool=tuple(args.batch_pool),
        max_upload_bytes=getattr(args, "batch_max_file_bytes", 100 * 2**20) + 2**16,
        replica_admin_key=getattr(args, "replica_admin_key", None)
        or os.environ.get("BATCHER_REPLICA_ADMIN_KEY"))


def fleet_key(args: argparse.Namespace) -> str | None:
    """--fleet-key-file, --fleet-key or BATCHER_FLEET_KEY, in that order."""
    if args.fleet_key_file:
        try:
            with open(args.fleet_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"--fleet-key-file: {exc.strerror}: {args.fleet_key_file}") from None
        if not key:
            raise SystemExit(f"--fleet-key-file {args.fleet_key_file} is empty")
        return key
    return args.fleet_key or os.environ.get("BATCHER_FLEET_KEY") or None


def ensure_fleet_key(cfg: RouterConfig, internal_host: str) -> None:
    """A router that takes heartbeats off loopback has a fleet key: generate one (printed once,
    for the operator to give the replicas) when none was configured."""
    from batcher.fleet.launcher import LOOPBACK

    if cfg.fleet_key or internal_host in LOOPBACK:
        return
    cfg.fleet_key = secrets.token_hex(16)
    print(f"batcher: generated a fleet key for heartbeats on {internal_host}; start replicas "
          f"with BATCHER_FLEET_KEY={cfg.fleet_key}", flush=True)


async def run_router(args: argparse.Namespace) -> int:
    from batcher.fleet.launcher import serve_router, wait_for_signal
    from batcher.system.gc_freeze import freeze_startup_heap

    cfg = router_config(args)
    if args.internal_port:
        ensure_fleet_key(cfg, args.internal_host)
    ctx = RouterContext(cfg)
    for spec in args.replica:
        url, _, admin = spec.partition(",")
        ctx.registry.add_static(url, admin_url=admin or None)
    freeze_startup_heap()
    close = await serve_router(ctx, args.host, args.port, args.admin_port, args.admin_host,
                               args.admin_key or os.environ.get("BATCHER_ADMIN_KEY"),
                               args.shutdown_timeout, args.internal_port, args.internal_host)
    sources: list[Source] = args.discover
    try:
        if sources:
            for src in sources:
                if args.discover_interval is not None:
                    src.interval = args.discover_interval
            hc = ctx.cfg.health
            # A failed first probe is retried every other health round.
            ctx.discovery = Discovery(ctx.registry, sources,
                                      HttpProber(hc.liveness_timeout, hc.probe_deadline,
                                                 cfg.replica_admin_key or cfg.fleet_key),
                                      ctx.forget, retry=hc.interval * 2,
                                      drain_timeout=args.discover_drain_timeout)
            await ctx.discovery.start()
        found = "".join(f", discovering {s.label}" for s in sources)
        print(f"batcher: routing on http://{args.host}:{args.port} over {len(args.replica)} "
              f"configured replicas{found}", flush=True)
        await wait_for_signal()
    finally:
        if ctx.discovery is not None:
            await ctx.discovery.close()
        await close()
    return 0


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The `batcher serve` flags of `args` that differ from their defaults, as argv."""
    from batcher.app.serve_flags import add_serve_args

    p = argparse.ArgumentParser(add_help=False)
    add_serve_args(p)
    out: list[str] = []
    for action in p._actions:
        dest = action.dest
        if not action.option_strings or dest in _OWN_FLAGS:
            continue
        value = getattr(args, dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def _slow(args: argparse.Namespace) -> tuple[int, float]:
    """`--slow-replicas K:F` as (K, F); (0, 1.0) when not given."""
    spec = getattr(args, "slow_replicas", None)
    if not spec:
        return 0, 1.0
    k, _, f = spec.partition(":")
    try:
        out = int(k), float(f)
    except ValueError:
        raise SystemExit(f"--slow-replicas takes K:F (e.g. 1:2), not {spec!r}") from None
    if out[0] < 0 or not out[1] > 0 or args.model != "fake":
        raise SystemExit("--slow-replicas needs K >= 0, F > 0 and --model fake")
    return out


def _own_batch_dirs(specs: list[ReplicaSpec]) -> None:
    """Each replica keeps its batch files and database under its own id in --data-dir (one
    server per data directory)."""
    for s in specs:
        for flag in ("--data-dir", "--batch-db"):
            if flag in s.argv:
                i = s.argv.index(flag) + 1
                path = Path(s.argv[i])
                s.argv[i] = str(path / s.replica_id if flag == "--data-dir"
                                else path.with_name(f"{path.stem}-{s.replica_id}{path.suffix}"))


async def run_fleet(args: argparse.Namespace) -> int:
    from batcher.fleet.launcher import Supervisor, replica_specs, serve_router, wait_for_signal

    if args.cells < 1:
        raise SystemExit("--cells must be >= 1")
    if args.cells > 1:
        from batcher.app.balancer_cli import run_cells

        return await run_cells(args, serve_flags(args))
    cfg = router_config(args)
    cfg.replica_admin_key = secrets.token_hex(16)
    fleet_key = cfg.fleet_key or secrets.token_hex(16)
    cfg.fleet_key = fleet_key
    ctx = RouterContext(cfg)
    from batcher.fleet.launcher import free_port

    # Heartbeats from the local replicas: on loopback, with the generated fleet key.
    internal_port = args.internal_port or free_port()
    routers = [f"http://127.0.0.1:{internal_port}", *args.router]
    versions = args.versions.split(",") if args.versions else [args.version]
    specs = replica_specs(args.replicas, [*serve_flags(args), "--log-level", args.log_level],
                          routers, versions, base_port=args.replica_base_port)
    _own_batch_dirs(specs)
    slow_k, slow_f = _slow(args)
    for s in specs[:slow_k]:
        s.argv += ["--fake-step-factor", str(slow_f)]
    for s in specs:
        ctx.registry.add_static(s.url, s.replica_id, s.admin_url)
    close = await serve_router(ctx, args.host, args.port, args.admin_port, args.admin_host,
                               args.admin_key or os.environ.get("BATCHER_ADMIN_KEY"),
                               internal_port=internal_port)
    sup = Supervisor(specs, {"BATCHER_ADMIN_KEY": cfg.replica_admin_key,
                             "BATCHER_FLEET_KEY": fleet_key}, restart=args.restart)
    ctx.processes = sup.status
    await sup.start()
    url = f"http://{args.host}:{args.port}"
    print(f"batcher: starting {args.replicas} replicas ("
          + ", ".join(s.url for s in specs) + f") behind {url}", flush=True)
    ready = asyncio.create_task(announce_ready(ctx.registry, args.replicas, url))
    try:
        await wait_for_signal()
    finally:
        ready.cancel()
        # Health checks end first: replicas that stop answering now are stopping, not failing.
        log.info("stopping the fleet: %d replicas drain (up to %gs), then the router closes",
                 len(specs), args.shutdown_timeout)
        if ctx.health is not None:
            await ctx.health.close()
        await sup.stop(args.shutdown_timeout)
        await close()
    return 0


async def announce_ready(registry: Registry, n: int, url: str, interval: float = 0.2) -> None:
    """Say that the fleet serves once all `n` replicas take work (loaded, warmed up, reached
    by the router), not when their processes start: until then requests get 503s."""
    while sum(registry.routable(r) for r in registry) < n:
        await asyncio.sleep(interval)
    print(f"batcher: fleet of {n} replicas ready behind {url}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batcher.app.fleet_cli", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_router_args(sub.add_parser("router", help="route over replicas"))
    add_fleet_args(sub.add_parser("fleet", help="start replicas and a router"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from batcher.http.listener import run_event_loop

    return run_event_loop(run_router(args) if args.command == "router" else run_fleet(args))


if __name__ == "__main__":
    sys.exit(main())
