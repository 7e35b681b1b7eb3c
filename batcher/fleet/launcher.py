"""Processes: serve a router (public app + admin app) and supervise local replica processes.

Contract:
- `serve_router(ctx, ...)` listens and returns an async closer; in-flight requests get
  `shutdown_timeout` seconds on close.
- `Supervisor` starts `batcher serve` replicas as child processes on loopback ports, reports
  every exit, restarts them with `restart=True` (1 s delay, doubling to 30 s while a replica
  keeps dying within 10 s of its start), and on `stop()` sends SIGTERM (the replicas drain),
  then SIGKILL after the timeout. It never signals anything it did not start.
- Replicas die with the launcher: on Linux each child asks the kernel for SIGTERM when its
  parent dies (`PR_SET_PDEATHSIG`), so even `kill -9` of `batcher fleet` leaves no replica
  running (a replica that is not in the launcher's hands would keep heartbeating, and hold
  its GPU memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batcher.fleet.router.admin import create_admin_app
from batcher.fleet.router.context import RouterContext
from batcher.fleet.router.internal import create_internal_app
from batcher.fleet.router.proxy import create_router_app
from batcher.http.listener import LISTEN_BACKLOG, keepalive_timeout, on_stop_signal, server_log

log = logging.getLogger("batcher.fleet")


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


async def serve_router(ctx: RouterContext, host: str, port: int, admin_port: int | None = None,
                       admin_host: str = "127.0.0.1", admin_key: str | None = None,
                       shutdown_timeout: float = 10.0, internal_port: int | None = None,
                       internal_host: str = "127.0.0.1") -> Callable[[], Awaitable[None]]:
    """Listen: the public app on `port`, the admin app on `admin_port` (with `admin_key`), the
    internal app (heartbeats) on `internal_port`. A listener is off when its port is None. An
    internal listener off loopback needs a fleet key (SystemExit otherwise)."""
    if admin_port and not admin_key:
        raise SystemExit("--admin-port needs --admin-key or BATCHER_ADMIN_KEY")
    if internal_port and internal_host not in LOOPBACK and not ctx.cfg.fleet_key:
        raise SystemExit("heartbeats off loopback need a fleet key (--fleet-key-file or "
                         "BATCHER_FLEET_KEY)")
    ctx.cfg.admin_key = admin_key or ctx.cfg.admin_key
    keepalive = keepalive_timeout()
    runners: list[web.AppRunner] = []

    async def listen(app: web.Application, at: str, on: int, **kw: Any) -> None:
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive,
                               logger=server_log(), **kw)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, at, on, reuse_address=True, backlog=LISTEN_BACKLOG).start()

    async def close() -> None:
        for runner in reversed(runners):
            await runner.cleanup()

    try:
        await listen(create_router_app(ctx), host, port, handler_cancellation=True,
                     shutdown_timeout=shutdown_timeout)
        if internal_port:
            await listen(create_internal_app(ctx), internal_host, internal_port)
        if admin_port and admin_key:
            await listen(create_admin_app(ctx, admin_key), admin_host, admin_port)
    except BaseException:
        await close()
        raise
    return close


async def wait_for_signal() -> None:
    """Until SIGTERM or SIGINT (Ctrl-C), which is logged."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal, sig, stop, log, "shutting down")
    await stop.wait()


# Ports handed to servers about to start are drawn from here, below the kernel's ephemeral range.
PICK_FROM = 20000
_handed: set[int] = set()
_pick = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The local ports the kernel gives outgoing connections (Linux's default when unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a server about to start: free now and not handed out before by this process,
    taken below the ephemeral range when there is room. A port the kernel picked (bind to 0)
    lies in that range, where every outgoing connection takes its local port, so one of them
    could take it before the server binds it; below it only a server binding it could."""
    lo, _ = ephemeral_range()
    for _ in range(64 if lo - PICK_FROM >= 1024 else 0):
        port = _pick.randrange(PICK_FROM, lo)
        if port in _handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed.add(port)
    return port


@dataclass(slots=True)
class ReplicaSpec:
    replica_id: str
    url: str
    admin_url: str | None
    argv: list[str]


@dataclass(slots=True)
class ReplicaProcess:
    spec: ReplicaSpec
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)


class Supervisor:
    """Starts, watches, restarts and stops replica processes."""

    def __init__(self, specs: list[ReplicaSpec], env: dict[str, str] | None = None,
                 restart: bool = False, restart_delay: float = 1.0):
        self.replicas = [ReplicaProcess(s) for s in specs]
        self.env = {**os.environ, **(env or {})}
        self.restart = restart
        self.restart_delay = restart_delay
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for rp in self.replicas:
            await self._spawn(rp)
            self._watchers.append(asyncio.get_running_loop().create_task(self._watch(rp)))

    async def _spawn(self, rp: ReplicaProcess) -> None:
        rp.proc = await asyncio.create_subprocess_exec(
            *rp.spec.argv, env=self.env, stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=die_with_parent())
        rp.started_at = time.monotonic()
        log.info("replica %s started (pid %d) on %s", rp.spec.replica_id, rp.proc.pid,
                 rp.spec.url)

    async def _watch(self, rp: ReplicaProcess) -> None:
        delay = self.restart_delay
        while rp.proc is not None:
            code = await rp.proc.wait()
            rp.exit_codes.append(code)
            if self._stopping:
                return
            print(f"batcher: replica {rp.spec.replica_id} (pid {rp.proc.pid}) exited with "
                  f"code {code}{'; restarting' if self.restart else ''}", flush=True)
            if not self.restart:
                return
            quick = time.monotonic() - rp.started_at < 10.0
            delay = min(30.0, delay * 2) if quick else self.restart_delay
            await asyncio.sleep(delay)
            if self._stopping:
                return
            rp.restarts += 1
            await self._spawn(rp)

    def status(self) -> list[dict[str, Any]]:
        return [{"replica_id": rp.spec.replica_id, "url": rp.spec.url,
                 "pid": rp.proc.pid if rp.proc else None,
                 "alive": rp.proc is not None and rp.proc.returncode is None,
                 "restarts": rp.restarts, "exit_codes": rp.exit_codes}
                for rp in self.replicas]

    async def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        live = [rp.proc for rp in self.replicas
                if rp.proc is not None and rp.proc.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in live))
        for t in self._watchers:
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this process dies, however it dies
    (`kill -9` included), so replicas never outlive their launcher holding a GPU. Linux only;
    elsewhere None (children then outlive a killed launcher)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            os._exit(70)
        if os.getppid() != parent:  # the launcher died before the signal was armed
            os._exit(70)

    return arm


def replica_specs(n: int, serve_flags: list[str], router_urls: list[str],
                  versions: list[str] | None = None, host: str = "127.0.0.1",
                  python: str = sys.executable, base_port: int | None = None
                  ) -> list[ReplicaSpec]:
    """N `batcher serve` command lines, each with an admin port: replica i on `base_port` + 2i
    and its admin port on the next, or on free loopback ports (see `free_port`) without one."""
    specs = []
    for i in range(n):
        if base_port is not None:
            port, admin = base_port + 2 * i, base_port + 2 * i + 1
        else:
            port, admin = free_port(host), free_port(host)
        rid = f"r{i}"
        argv = [python, "-m", "batcher.app.cli", "serve", *serve_flags, "--host", host,
                "--port", str(port), "--admin-port", str(admin), "--replica-id", rid]
        if versions:
            argv += ["--deployment-version", versions[i % len(versions)]]
        for r in router_urls:
            argv += ["--router", r]
        specs.append(ReplicaSpec(rid, f"http://{host}:{port}", f"http://{host}:{admin}", argv))
    return specs
