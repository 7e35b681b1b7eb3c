"""Everything `batcher serve` can check without the model, checked before the model loads: a
large model takes minutes to load on a GPU, and a typo in a flag, an unreadable tenants file, a
missing admin key or a port already in use must not wait for it.

`preflight(args)` reads and validates the settings, loads the tenants, and binds the listening
sockets (bound, not yet listening: a client is refused, not left hanging, while the model
loads). It raises `StartupError`, whose message is one line for the operator.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig, load_tenants


class StartupError(Exception):
    """A setting the server cannot start with; the message is shown to the operator as is."""


@dataclass(slots=True)
class Preflight:
    """What `run_server` needs that was checked before the model loads."""

    tenants: dict[str, TenantConfig] | None
    admin_key: str | None
    keepalive_s: float
    batch_config: Any  # batcher.batch.service.BatchConfig | None
    sock: socket.socket
    admin_sock: socket.socket | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def close(self) -> None:
        """Release the sockets (a start that failed after binding)."""
        for s in (self.sock, self.admin_sock):
            if s is not None:
                s.close()


def api_key_tenants(keys: list[str]) -> dict[str, TenantConfig]:
    """`--api-key`: one tenant, no budget, any of `keys` (stored only as SHA-256 hashes)."""
    hashes = tuple(dict.fromkeys(hashlib.sha256(k.encode()).hexdigest() for k in keys))
    # The auth-off tenant's name: one tenant for every key, as for no key at all (the
    # gateway's cool-downs then tell callers apart by address, `server.gateway.cooldown_key`).
    name = DEFAULT_TENANT.name
    return {name: TenantConfig(name=name, key_sha256=hashes, tokens_per_minute=math.inf,
                               max_concurrent=sys.maxsize)}


def _tenants(args: argparse.Namespace) -> dict[str, TenantConfig] | None:
    keys = [k for k in getattr(args, "api_key", None) or [] if k.strip()]
    if keys and args.tenants:
        raise StartupError("--api-key and --tenants are exclusive: list the key in the "
                           "tenants file instead")
    if keys:
        return api_key_tenants([k.strip() for k in keys])
    if not args.tenants:
        return None
    try:
        return load_tenants(args.tenants)
    except OSError as exc:
        raise StartupError(f"--tenants {args.tenants}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise StartupError(f"--tenants: {exc}") from None


def bind(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to `host:port`, not yet listening."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{flag}: cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # SO_REUSEADDR lets a restarted server bind while the old connections sit in TIME_WAIT;
        # on Linux it still refuses a port another process listens on.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def preflight(args: argparse.Namespace) -> Preflight:
    """Check every setting and bind the listeners; `StartupError` names the first problem."""
    from batcher.batch import service as batch

    from batcher.app.serve_flags import engine_config_from_args

    config = engine_config_from_args(args)
    try:
        config.scheduler_config().validate()
        config.cache_config().validate()
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < float("inf"):
            raise StartupError(f"--{flag.replace('_', '-')} must be >= 0 ms, got {value}")
    tenants = _tenants(args)
    admin_key = args.admin_key or os.environ.get("BATCHER_ADMIN_KEY") or None
    if args.admin_port and not admin_key:
        raise StartupError("--admin-port needs --admin-key or BATCHER_ADMIN_KEY")
    keepalive = getattr(args, "keepalive_timeout", None) or _env_keepalive()
    sock = bind(args.host, args.port, "--port")
    try:  # after binding: the default data directory is named by the port in use
        batch_config = batch.config_from_args(args, sock.getsockname()[1])
    except ValueError as exc:
        sock.close()
        raise StartupError(str(exc)) from None
    admin_sock = None
    if args.admin_port:
        try:
            admin_sock = bind(args.admin_host, args.admin_port, "--admin-port")
        except StartupError:
            sock.close()
            raise
    return Preflight(tenants, admin_key, keepalive, batch_config, sock, admin_sock)


def _env_keepalive() -> float:
    from batcher.http.listener import keepalive_timeout

    try:
        return keepalive_timeout()
    except SystemExit as exc:
        raise StartupError(str(exc.code)) from None


__all__ = ["Preflight", "StartupError", "api_key_tenants", "bind",
           "preflight"]
