"""Where a router learns replica addresses: static lists, watched files, DNS names.

Each source's `poll()` returns its newest answer, or None to keep the previous one (a failed
read or resolver hiccup never drains the fleet; NXDOMAIN / no data is an answer: no addresses).
`parse_source` turns a `--discover` spec (`static:`, `file:`, `dns:`) into a source.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from batcher.fleet.router.registry import replica_id_for

log = logging.getLogger("batcher.fleet.discovery")

DNS_INTERVAL = 5.0  # a headless Service's records follow pod readiness within seconds
FILE_INTERVAL = 1.0  # a stat per second costs nothing and makes edits feel immediate
STATIC_INTERVAL = 60.0  # never changes; polled only so the code path is the same
# Resolver failures that mean "this name has no addresses", not "the resolver is unwell".
_EMPTY_ANSWERS = frozenset(getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA")
                           if hasattr(socket, n))


@dataclass(frozen=True, slots=True)
class Target:
    """One replica address as a source reports it."""

    url: str
    admin_url: str | None = None

    @property
    def replica_id(self) -> str:
        return replica_id_for(self.url)


def parse_url(raw: str) -> str:
    """A replica base URL (`http(s)://host:port`), without a trailing slash; ValueError if not."""
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {raw!r}")
    try:
        parts.port  # noqa: B018 (raises on a malformed port)
    except ValueError:
        raise ValueError(f"bad port in {raw!r}") from None
    return url


def parse_target(line: str) -> Target:
    """`URL` or `URL,ADMIN_URL` (the form `--replica` takes)."""
    url, _, admin = line.partition(",")
    return Target(parse_url(url), parse_url(admin) if admin.strip() else None)


class Source(Protocol):
    """Where addresses come from. `poll()` returns the full current answer, or None to keep the
    previous one (nothing changed, or the source could not be read)."""

    label: str
    interval: float

    async def poll(self) -> list[Target] | None: ...


class StaticSource:
    def __init__(self, urls: Iterable[str], interval: float = STATIC_INTERVAL):
        self.targets = [Target(parse_url(u)) for u in urls if u.strip()]
        if not self.targets:
            raise ValueError("static: needs at least one URL")
        self.label = "static:" + ",".join(t.url for t in self.targets)
        self.interval = interval

    async def poll(self) -> list[Target] | None:
        return list(self.targets)


class FileSource:
    def __init__(self, path: str | os.PathLike[str], interval: float = FILE_INTERVAL):
        self.path = Path(path)
        self.label = f"file:{self.path}"
        self.interval = interval
        self._seen: tuple[int, int, int] | None = None
        self._failing = False

    async def poll(self) -> list[Target] | None:
        try:
            st = self.path.stat()
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig == self._seen:
                return None
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            if not self._failing:  # once per outage, not once per second
                log.warning("%s: cannot read (%s); keeping the last list", self.label, exc)
            self._failing = True
            return None
        self._failing = False
        self._seen = sig
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                out.append(parse_target(line))
            except ValueError as exc:  # one bad line must not drop every other replica
                log.warning("%s line %d ignored: %s", self.label, n, exc)
        return out


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_all(host: str, port: int) -> list[str]:
    """Every IPv4 and IPv6 address of `host`, sorted, without duplicates."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(sa[0]) for family, _, _, _, sa in infos
                   if family in (socket.AF_INET, socket.AF_INET6)})


class DnsSource:
    def __init__(self, host: str, port: int, interval: float = DNS_INTERVAL,
                 resolve: Resolver = resolve_all, timeout: float = 5.0):
        if not host or not 0 < port < 65536:
            raise ValueError("dns: needs NAME:PORT with a port in 1..65535")
        self.host, self.port = host, port
        self.label = f"dns:{host}:{port}"
        self.interval = interval
        self.resolve = resolve
        self.timeout = timeout
        self._failing = False

    async def poll(self) -> list[Target] | None:
        try:
            async with asyncio.timeout(self.timeout):
                addrs = await self.resolve(self.host, self.port)
        except socket.gaierror as exc:
            if exc.errno not in _EMPTY_ANSWERS:
                self._keep(exc)
                return None
            addrs = []
        except (OSError, TimeoutError) as exc:
            self._keep(exc)
            return None
        self._failing = False
        out = []
        for a in addrs:
            if "%" in a:  # link-local with a zone: not an address another host can use
                continue
            host = f"[{a}]" if ":" in a else a
            out.append(Target(f"http://{host}:{self.port}"))
        return out

    def _keep(self, exc: BaseException) -> None:
        if not self._failing:
            log.warning("%s: resolving failed (%s); keeping the last answer", self.label,
                        exc or type(exc).__name__)
        self._failing = True


def parse_source(spec: str) -> Source:
    """`static:URL,URL`, `file:PATH` or `dns:NAME:PORT`; ValueError (an argparse error when
    used as `type=`) for anything else."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"expected static:URL,URL | file:PATH | dns:NAME:PORT, got {spec!r}")
    if kind == "static":
        return StaticSource(rest.split(","))
    if kind == "file":
        return FileSource(rest)
    if kind == "dns":
        name, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"dns: needs NAME:PORT, got {rest!r}")
        return DnsSource(name.strip("[]"), int(port))
    raise ValueError(f"unknown discovery kind {kind!r} (static, file or dns)")
