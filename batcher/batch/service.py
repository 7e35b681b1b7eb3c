"""Wiring the batch tier into a server app: the store, the executor over the app's gateway and
its lifetime (started after the engine, stopped before it)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from aiohttp import web

from batcher.batch.api_state import BATCH, BatchLimits, BatchService
from batcher.batch.executor import BatchExecutor
from batcher.batch.file_upload import upload_body_limit
from batcher.batch.gate import GateConfig, SpareCapacity
from batcher.batch.lines import LineRunner
from batcher.batch.metrics import BatchMetrics
from batcher.batch.routes import add_routes
from batcher.batch.store import BatchStore, lock_data_dir
from batcher.batch.validate import LineCheck
from batcher.http.listener import expect_continue
from batcher.server.app import BODY_LIMIT, GATEWAY
from batcher.server.gateway import Gateway
from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig

log = logging.getLogger("batcher.batch")


@dataclass(slots=True)
class BatchConfig:
    """`data_dir` holds `files/` and, unless `db_path` says otherwise, `batches.sqlite3`."""

    data_dir: Path
    db_path: Path | None = None
    limits: BatchLimits = field(default_factory=BatchLimits)
    gate: GateConfig = field(default_factory=GateConfig)
    lock: BinaryIO | None = None  # the data directory's lock, when already taken


def tenant_lookup(gw: Gateway):
    """Tenant name -> its current config (None once removed from the tenants file)."""

    def lookup(name: str) -> TenantConfig | None:
        tenants = gw.auth.tenants
        if not tenants:
            return DEFAULT_TENANT if name == DEFAULT_TENANT.name else None
        return tenants.get(name)

    return lookup


def install(app: web.Application, cfg: BatchConfig) -> None:
    """Serve the batch API on `app` (a `create_app` extension): its routes, the upload limit,
    and the store and executor for as long as the app runs."""
    cfg.gate.validate()
    cfg.limits.validate()
    add_routes(app, expect_handler=expect_continue)
    app[BODY_LIMIT] = upload_body_limit

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        gw = app[GATEWAY]
        store = BatchStore(cfg.data_dir, cfg.db_path, lock=cfg.lock)
        executor = BatchExecutor(store, LineRunner(gw),
                                 SpareCapacity(gw.engine, gw.admission, cfg.gate),
                                 tenant_lookup(gw), BatchMetrics(gw.metrics.registry),
                                 file_expiry_s=cfg.limits.file_expiry_s)
        # Every step may have freed capacity (or ended a line): look again at once.
        gw.engine.step_listeners.append(executor.wake)
        app[BATCH] = BatchService(store, executor, cfg.limits, LineCheck(gw))
        await executor.start()
        try:
            yield
        finally:
            await executor.stop()
            store.close()

    app.cleanup_ctx.append(lifetime)


async def stop_executor(app: web.Application) -> None:
    """Stop starting batch lines and end the running ones (they run again after a restart):
    the first step of a graceful shutdown, so draining waits only for live requests."""
    svc = app.get(BATCH)
    if svc is not None:
        await svc.executor.stop()


def add_batch_serve_args(p: argparse.ArgumentParser) -> None:
    """The batch tier's `batcher serve` flags."""
    g = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument("--data-dir", default=None, help="directory for the batch tier's files and "
                   "database (default: $XDG_DATA_HOME/batcher/port-PORT, or "
                   "~/.local/share/batcher/port-PORT; a restart on the same port finds its "
                   "batches again)")
    g.add_argument("--no-batch-api", action="store_true", help="serve no batch API "
                   "(/v1/files and /v1/batches answer 404) and keep no data directory")
    g.add_argument("--batch-db", default=None, help="SQLite database path (default: "
                   "DATA_DIR/batches.sqlite3)")
    d = BatchLimits()
    g.add_argument("--batch-max-file-bytes", type=int, default=d.max_file_bytes,
                   help="largest file upload (default: %(default)s)")
    g.add_argument("--batch-max-line-bytes", type=int, default=d.max_line_bytes,
                   help="largest request (line) in a batch input file; a file with a longer "
                   "line is refused (default: %(default)s)")
    g.add_argument("--batch-max-file-bytes-per-tenant", type=int, default=d.max_tenant_bytes,
                   help="bytes of files one tenant may store, batch outputs included; an upload "
                   "past it is refused (default: %(default)s)")
    g.add_argument("--batch-max-files-per-tenant", type=int, default=d.max_tenant_files,
                   help="files one tenant may store, batch outputs included (default: "
                   "%(default)s)")
    g.add_argument("--batch-file-expiry", type=float, default=d.file_expiry_s,
                   help="seconds a file is kept unless its upload sets 'expires_after' (batch "
                   "outputs too); 0: until deleted (default: %(default)s, 30 days)")
    g.add_argument("--batch-max-running", type=int, default=GateConfig().max_running,
                   help="batch lines in the engine at once (default: %(default)s)")
    g.add_argument("--batch-max-running-beside", type=int, default=None,
                   help="batch lines in flight at once while interactive requests run or ran "
                        "within the last second (default: 1 where the model runs on the CPU, "
                        "else --batch-max-running)")
    g.add_argument("--batch-starts-per-s-beside", type=float, default=None,
                   help="batch lines started a second at most while interactive requests run "
                        "or ran within the last second (default: 20 where the model runs on "
                        "the CPU, else no limit)")
    g.add_argument("--batch-ttft-share", type=float, default=GateConfig().ttft_share,
                   help="a batch line starts only while an interactive request arriving after "
                   "it is predicted within this share of the TTFT SLO (default: %(default)s)")
    g.add_argument("--batch-shed-share", type=float, default=GateConfig().shed_share,
                   help="running batch lines are shed (and run again later) while an "
                   "interactive request arriving now is predicted past this share of the TTFT "
                   "SLO (default: %(default)s)")


# Servers sharing one filesystem and one port number (network namespaces, pods on one volume)
# take the next free sibling of the port's directory; this many are tried.
_DEFAULT_DIR_TRIES = 64


def default_data_dir(port: int, attempt: int = 0) -> Path:
    """Where the batch tier keeps its state when `--data-dir` is not given: a directory named by
    the listening port, so a server restarted on its port finds its batches again; `attempt` >
    0: that directory's siblings, for a server whose port's directory another one holds."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return Path(base) / "batcher" / (f"port-{port}" + (f".{attempt}" if attempt else ""))


def config_from_args(args: argparse.Namespace, port: int) -> BatchConfig | None:
    """The batch tier's config for a server listening on `port`, or None with
    `--no-batch-api` (or when the default data directory cannot be made). ValueError on bad
    values, or when the `--data-dir` given cannot be made."""
    if args.no_batch_api:
        return None
    for flag in ("max_file_bytes", "max_line_bytes", "max_file_bytes_per_tenant",
                 "max_files_per_tenant"):
        if getattr(args, f"batch_{flag}") < 1:
            raise ValueError(f"--batch-{flag.replace('_', '-')} must be >= 1")
    if not args.batch_file_expiry >= 0:
        raise ValueError("--batch-file-expiry must be >= 0 seconds")
    gate = GateConfig(max_running=args.batch_max_running,
                      max_running_beside=args.batch_max_running_beside,
                      starts_per_s_beside=args.batch_starts_per_s_beside,
                      ttft_share=args.batch_ttft_share,
                      shed_share=args.batch_shed_share)
    limits = BatchLimits(max_file_bytes=args.batch_max_file_bytes,
                         max_line_bytes=args.batch_max_line_bytes,
                         max_tenant_bytes=args.batch_max_file_bytes_per_tenant,
                         max_tenant_files=args.batch_max_files_per_tenant,
                         file_expiry_s=args.batch_file_expiry or None)
    db = Path(args.batch_db) if args.batch_db else None
    if args.data_dir:
        data_dir = Path(args.data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--data-dir {data_dir} cannot be made: {exc.strerror}") from None
        return BatchConfig(data_dir, db, limits.validate(), gate.validate())
    for attempt in range(_DEFAULT_DIR_TRIES):
        data_dir = default_data_dir(port, attempt)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            lock = lock_data_dir(data_dir)
        except OSError as exc:
            # Not asked for: a read-only home (a locked-down container) serves without the tier.
            log.warning("no batch API: the default data directory %s cannot be made (%s); give "
                        "a writable --data-dir, or --no-batch-api to say so", data_dir,
                        exc.strerror)
            return None
        if lock is not None:
            return BatchConfig(data_dir, db, limits.validate(), gate.validate(), lock)
    log.warning("no batch API: the default data directories under %s are all in use by other "
                "servers; give --data-dir", default_data_dir(port).parent)
    return None
