"""Discovery: how a router learns replica addresses besides heartbeats.

Sources (`batcher router --discover SPEC`, repeatable), all behind `Source.poll()`:
- `static:URL,URL,...`: a fixed list.
- `file:PATH`: one `URL` (or `URL,ADMIN_URL`) per line, `#` comments and blank lines ignored;
  re-read whenever the file's mtime, size or inode changes (write it by rename to be safe).
- `dns:NAME:PORT`: every A and AAAA record of NAME (through the event loop's `getaddrinfo`),
  re-resolved every few seconds: a Kubernetes headless Service lists its ready pods this way.

Contract:
- Each source's newest answer replaces its previous one; a poll that fails (unreadable file,
  resolver timeout or SERVFAIL) keeps the previous answer, so a resolver hiccup never drains the
  fleet. A name that does not exist (NXDOMAIN / no data) is an answer: no addresses.
- The wanted set is the union of all answers. An address that appears is probed (`/health`,
  `/v1/state` healthy and not draining, then the one-token `/v1/probe`) and joins the registry
  only after its first good probe, so a replica still loading its model is never routable.
  Failed probes are retried every `retry` seconds while the address stays wanted.
- An address that disappears is drained: no new work goes to it at once (`router_draining`),
  requests the router has in flight there finish, and once none remain (or `drain_timeout`
  passed) the replica is forgotten. If it reappears first, the drain is lifted.
- Discovery never adds, drains or forgets a replica that joined another way (`--replica`, a
  heartbeat): an address the registry already holds is left to that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from batcher.engine.snapshot import EngineSnapshot
from batcher.fleet.router.discovery_sources import (  # noqa: F401  (re-exported)
    DnsSource,
    FileSource,
    Source,
    StaticSource,
    Target,
    parse_source,
    parse_target,
    parse_url,
    resolve_all,
)
from batcher.fleet.router.registry import Registry

log = logging.getLogger("batcher.fleet.discovery")

Prober = Callable[[Target], Awaitable[EngineSnapshot | str]]


class HttpProber:
    """The first probe of a new address: alive, healthy and not draining by its own state, and
    one token generated within the deadline (when the replica lets this router probe: the probe
    needs its admin or fleet key, `key`). Returns the state, or why not."""

    def __init__(self, timeout: float = 0.5, probe_deadline: float = 2.0,
                 key: str | None = None):
        self.timeout = timeout
        self.probe_deadline = probe_deadline
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, target: Target) -> EngineSnapshot | str:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        s, url = self._session, target.url
        short = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with s.get(url + "/health", timeout=short) as resp:
                if resp.status != 200:
                    return f"/health answered {resp.status}"
            async with s.get(url + "/v1/state", timeout=short) as resp:
                if resp.status != 200:
                    return f"/v1/state answered {resp.status}"
                state = EngineSnapshot.from_wire(orjson.loads(await resp.read()))
            if not state.healthy or state.draining:
                return "not healthy" if not state.healthy else "draining"
            deadline = self.probe_deadline
            long = aiohttp.ClientTimeout(total=deadline + self.timeout)
            async with s.post(f"{url}/v1/probe?timeout={deadline:g}", timeout=long,
                              headers=self.headers) as resp:
                # 401: this router may not probe it; liveness and state above are the test.
                if resp.status not in (200, 401):
                    return f"probe answered {resp.status}"
        except TimeoutError:
            return "no answer in time"
        except aiohttp.ClientError as exc:
            return type(exc).__name__
        except ValueError as exc:  # unparsable state
            return str(exc)
        return state

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(slots=True)
class _Pending:
    target: Target
    since: float
    next_at: float
    tries: int = 0
    last_error: str = ""
    task: asyncio.Task[None] | None = None


@dataclass(slots=True)
class _Leaving:
    since: float
    was_draining: bool  # an operator's drain stays if the address comes back


class Discovery:
    """Keeps the registry's discovered replicas equal to what the sources say (see the module
    contract). Lives on the event loop; no locks."""

    def __init__(self, registry: Registry, sources: Sequence[Source], probe: Prober,
                 on_forget: Callable[[str], None] | None = None, *, retry: float = 1.0,
                 tick: float = 0.25, drain_timeout: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.sources = list(sources)
        self.probe = probe
        self.on_forget = on_forget or self._remove
        self.retry, self.tick, self.drain_timeout = retry, tick, drain_timeout
        self.clock = clock
        self.answers: dict[int, dict[str, Target]] = {}
        self.owned: dict[str, Target] = {}  # discovered replicas now in the registry
        self.pending: dict[str, _Pending] = {}  # wanted, waiting for a first good probe
        self.leaving: dict[str, _Leaving] = {}  # gone from every source, draining
        self._tasks: list[asyncio.Task[None]] = []

    # state ----------------------------------------------------------------------------------
    def wanted(self) -> dict[str, Target]:
        out: dict[str, Target] = {}
        for answer in self.answers.values():
            for rid, t in answer.items():
                if rid not in out or (t.admin_url and not out[rid].admin_url):
                    out[rid] = t
        return out

    async def poll(self, i: int) -> bool:
        """Ask source `i` once; True when its answer changed."""
        got = await self.sources[i].poll()
        if got is None:
            return False
        answer = {t.replica_id: t for t in got}
        if answer == self.answers.get(i):
            return False
        self.answers[i] = answer
        log.info("%s: %d addresses", self.sources[i].label, len(answer))
        return True

    def reconcile(self) -> None:
        """Admit, drain, undrain and forget to match the sources. Starts probes; never waits."""
        now, reg = self.clock(), self.registry
        wanted = self.wanted()
        for rid, t in wanted.items():
            rep = reg.get(rid)
            if rid in self.owned and rep is not None:
                leave = self.leaving.pop(rid, None)
                if leave is not None:
                    rep.router_draining = leave.was_draining
                    log.info("replica %s is back in discovery: drain lifted", rid)
                if t.admin_url and rep.admin_url != t.admin_url:
                    rep.admin_url = t.admin_url
            elif rid in self.owned:  # removed behind our back (e.g. forgotten): start again
                del self.owned[rid]
                self.leaving.pop(rid, None)
            elif rep is not None or self._known_url(t.url):
                continue  # joined another way: that path owns it
            if rid not in self.owned and rid not in self.pending:
                self.pending[rid] = _Pending(t, now, now)
        for rid in [r for r in self.pending if r not in wanted]:
            p = self.pending.pop(rid)
            if p.task is not None:
                p.task.cancel()
        for rid in self.owned.keys() - wanted.keys() - self.leaving.keys():
            rep = reg.get(rid)
            was = rep.router_draining if rep is not None else False
            self.leaving[rid] = _Leaving(now, was)
            if rep is not None:
                rep.router_draining = True
            log.info("replica %s left discovery: draining (%d in flight)", rid,
                     rep.inflight if rep is not None else 0)
        for rid, leave in list(self.leaving.items()):
            rep = reg.get(rid)
            if rep is not None and rep.inflight and now - leave.since < self.drain_timeout:
                continue
            del self.leaving[rid]
            self.owned.pop(rid, None)
            if rep is not None:
                self.on_forget(rid)
            log.info("replica %s forgotten", rid)
        for p in self.pending.values():
            if (p.task is None or p.task.done()) and now >= p.next_at:
                p.task = asyncio.get_running_loop().create_task(self._admit(p))

    def _remove(self, replica_id: str) -> None:
        self.registry.remove(replica_id)

    def _known_url(self, url: str) -> bool:
        return any(r.url == url for r in self.registry)

    async def _admit(self, p: _Pending) -> None:
        try:
            got = await self.probe(p.target)
        except Exception as exc:  # a prober bug counts as a failed probe, retried later
            log.exception("probing %s failed", p.target.url)
            got = f"probe error: {type(exc).__name__}"
        rid = p.target.replica_id
        if self.pending.get(rid) is not p:
            return  # withdrawn while probing
        p.tries += 1
        now = self.clock()
        if isinstance(got, str):
            if p.tries == 1 or got != p.last_error:
                log.info("replica %s not admitted yet: %s", rid, got)
            p.last_error, p.next_at = got, now + self.retry
            return
        del self.pending[rid]
        if self.registry.get(rid) is not None or self._known_url(p.target.url):
            return  # joined by heartbeat while we probed
        self.registry.add_static(p.target.url, rid, p.target.admin_url)
        self.registry.observe(rid, got, now, poll=True)
        self.owned[rid] = p.target
        log.info("replica %s admitted after its first good probe (%d tries, %.1fs)", rid,
                 p.tries, now - p.since)

    def status(self) -> dict[str, Any]:
        """JSON-ready view: sources and the addresses in each phase."""
        return {"sources": [s.label for s in self.sources], "owned": sorted(self.owned),
                "pending": {rid: p.last_error for rid, p in self.pending.items()},
                "leaving": sorted(self.leaving)}

    # lifetime -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Poll every source once (so the first reconcile sees all of them), then keep polling
        each at its own interval and reconciling every `tick`."""
        loop = asyncio.get_running_loop()
        for i in range(len(self.sources)):
            await self._poll_logged(i)
        self.reconcile()
        self._tasks = [loop.create_task(self._source_loop(i)) for i in range(len(self.sources))]
        self._tasks.append(loop.create_task(self._tick_loop()))

    async def _poll_logged(self, i: int) -> bool:
        try:
            return await self.poll(i)
        except Exception:  # a bug in one source must not stop the others
            log.exception("%s: poll failed", self.sources[i].label)
            return False

    async def _source_loop(self, i: int) -> None:
        while True:
            await asyncio.sleep(self.sources[i].interval)
            if await self._poll_logged(i):
                self.reconcile()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                self.reconcile()
            except Exception:
                log.exception("discovery reconcile failed")

    async def close(self) -> None:
        tasks = [*self._tasks, *(p.task for p in self.pending.values() if p.task is not None)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        closer = getattr(self.probe, "close", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()
