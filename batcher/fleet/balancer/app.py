"""The global balancer: the router's machinery with cells as its upstreams.

A cell is a router (`batcher router` or `batcher fleet`) with its own registry and replicas. The
balancer speaks the same OpenAI API on the same trust boundary as a router (tenant keys pass
through to the replicas that check them; an admin listener with its own key; cells' deep probes
with the cells' key), and reuses the router's pieces unchanged: the relays (`forward.py`, `stream_relay.py`: retries
before the first byte under the retry budget, same request id, failover after), the health
checker (liveness, `/v1/state` polls, deep probes, eviction and re-admission), the admin
listener (drain a cell: `POST /admin/drain {"replica": CELL}`) and the retry budget. What
differs is the choice: `balancer.choose_cell` on the saturation each cell publishes, instead of
the replica policy, and early shedding (503 + Retry-After) when every cell is saturated.

`CellRegistry` keeps the additions a cell publishes (`saturation`, `healthy_replicas`,
`predicted_wait_s`) next to the contract state the router's registry already parses, from polls
and from the `X-Replica-State` header of every answer alike.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batcher.engine.snapshot import EngineSnapshot
from batcher.fleet.router.admin import create_admin_app
from batcher.fleet.balancer.policy import (
    BalancerConfig,
    CellView,
    cell_saturation,
    choose_cell,
    retry_after,
)
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import GENERATION_PATHS, create_router_app
from batcher.fleet.router.registry import Registry, Replica
from batcher.http.errors import ApiError
from batcher.http.listener import LISTEN_BACKLOG, keepalive_timeout, server_log


@dataclass(slots=True)
class CellFigures:
    """What a cell publishes beyond the replica contract."""

    saturation: float
    healthy_replicas: int
    predicted_wait_s: float


def _number(data: Mapping[str, Any], key: str) -> float | None:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


class CellRegistry(Registry):
    """The router's registry, keeping each cell's published saturation as well. A cell that
    publishes none (an older router) is judged by `cell_saturation` on its contract figures."""

    def __init__(self, *args: Any, balancer: BalancerConfig, **kw: Any):
        super().__init__(*args, **kw)
        self.balancer = balancer
        self.figures: dict[str, CellFigures] = {}

    def observe(self, replica_id: str, state: Mapping[str, Any] | EngineSnapshot, now: float,
                poll: bool = False) -> bool:
        ok = super().observe(replica_id, state, now, poll)
        if ok and isinstance(state, Mapping):
            st = self.replicas[replica_id].state
            assert st is not None
            healthy = _number(state, "healthy_replicas")
            hr = int(healthy) if healthy is not None else int(st.healthy)
            wait = _number(state, "predicted_wait_s") or 0.0
            sat = _number(state, "saturation")
            if sat is None:
                sat = cell_saturation(st.free_blocks, st.total_blocks, st.waiting, hr, wait,
                                      self.balancer)
            self.figures[replica_id] = CellFigures(min(1.0, sat), hr, wait)
        return ok

    def remove(self, replica_id: str) -> Replica | None:
        self.figures.pop(replica_id, None)
        return super().remove(replica_id)


class BalancerContext(RouterContext):
    """A router context whose upstreams are cells."""

    registry: CellRegistry

    def __init__(self, cfg: RouterConfig, balancer: BalancerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        super().__init__(cfg, clock, rng)
        self.balancer = (balancer or BalancerConfig()).validate()
        self.use_registry(CellRegistry(cfg.beat_interval, cfg.suspect_beats,
                                       max_replicas=cfg.max_replicas, balancer=self.balancer))
        self.metrics.registry.register(CellCollector(self))
        self.shed = 0

    def views(self) -> list[CellView]:
        reg, now = self.registry, self.clock()
        out = []
        for rep in reg:
            fig = reg.figures.get(rep.replica_id)
            routable = fig is not None and reg.routable(rep)
            total = rep.state.total_blocks if rep.state is not None else 0
            pending = rep.unreflected_blocks
            out.append(CellView(rep.replica_id, fig.saturation if fig else 1.0, routable,
                                fresh=not reg.suspect(rep, now),
                                healthy_replicas=fig.healthy_replicas if fig else 0,
                                unreflected=pending / total if total > 0 else 0.0))
        return out

    def pick(self, tokens: int, key: str | None, exclude: set[str],
             prompt_tokens: int | None = None) -> Replica | None:
        started = time.perf_counter()
        # The relay's affinity key is "<tenant scope>\0<prompt prefix>"; cells are chosen by
        # the tenant alone (the balancer is built with affinity on for every prompt length).
        tenant = key.partition("\x00")[0] if key is not None else None
        c = choose_cell(self.views(), tenant, self.balancer, self.rng, exclude)
        self.metrics.routing.observe(time.perf_counter() - started)
        return None if c is None else self.registry.get(c.cell_id)

    def shed_now(self) -> int | None:
        """Retry-After seconds when no cell can take a new request now, else None."""
        views = self.views()
        if choose_cell(views, None, self.balancer, random.Random(0)) is not None:
            return None
        return retry_after(views, self.balancer)


class CellCollector(Collector):
    """`batcher_cell_saturation{cell}` and the fleet aggregates, read at scrape time."""

    def __init__(self, ctx: BalancerContext):
        self.ctx = ctx

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ctx = self.ctx
        reg = ctx.registry
        sat = GaugeMetricFamily("batcher_cell_saturation", "Saturation a cell publishes, 0-1 "
                                "(1 for a cell that is not routable)", labels=["cell"])
        healthy = GaugeMetricFamily("batcher_cell_healthy_replicas", "Healthy replicas a "
                                    "cell reports", labels=["cell"])
        for v in ctx.views():
            sat.add_metric([v.cell_id], v.saturation if v.routable else 1.0)
            healthy.add_metric([v.cell_id], v.healthy_replicas if v.routable else 0)
        live = [r.state for r in reg if reg.routable(r) and r.state is not None]
        yield sat
        yield healthy
        for name, doc, value in (
                ("batcher_fleet_kv_free_blocks", "Free KV blocks over routable cells",
                 sum(s.free_blocks for s in live)),
                ("batcher_fleet_kv_total_blocks", "KV blocks over routable cells",
                 sum(s.total_blocks for s in live)),
                ("batcher_fleet_running", "Running requests over routable cells",
                 sum(s.running for s in live)),
                ("batcher_fleet_waiting", "Waiting requests over routable cells",
                 sum(s.waiting for s in live)),
                ("batcher_fleet_routable_cells", "Cells the balancer can route to", len(live))):
            yield GaugeMetricFamily(name, doc, value=value)


def shed_middleware(ctx: BalancerContext) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def shed(request: web.Request, handler: Callable[[web.Request],
                   Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method == "POST" and request.path in GENERATION_PATHS:
            wait = ctx.shed_now()
            if wait is not None:
                ctx.shed += 1
                ctx.metrics.client_requests.labels("rejected").inc()
                raise ApiError(503, "every cell is saturated; retry later", code="overloaded",
                               retry_after=wait)
        return await handler(request)

    return shed


def create_balancer_app(ctx: BalancerContext) -> web.Application:
    """The router's public app over cells, shedding early when every cell is saturated."""
    app = create_router_app(ctx, cell_name=None)
    # Inside the router's middleware, so a shed answer gets its request id and error shape.
    app.middlewares.append(shed_middleware(ctx))
    return app


async def serve_balancer(ctx: BalancerContext, host: str, port: int,
                         admin_port: int | None = None, admin_host: str = "127.0.0.1",
                         admin_key: str | None = None, shutdown_timeout: float = 10.0
                         ) -> Callable[[], Awaitable[None]]:
    """Listen: the public app on `port`, the admin app on `admin_port` (it needs `admin_key`).
    There is no internal listener: cells are polled, they do not heartbeat. Returns a closer."""
    if admin_port and not admin_key:
        raise SystemExit("--admin-port needs --admin-key or BATCHER_ADMIN_KEY")
    ctx.cfg.admin_key = admin_key or ctx.cfg.admin_key
    runners: list[web.AppRunner] = []

    async def close() -> None:
        for runner in reversed(runners):
            await runner.cleanup()

    try:
        apps: list[tuple[web.Application, str, int, dict[str, Any]]] = [
            (create_balancer_app(ctx), host, port,
             {"handler_cancellation": True, "shutdown_timeout": shutdown_timeout})]
        if admin_port and admin_key:
            apps.append((create_admin_app(ctx, admin_key), admin_host, admin_port, {}))
        for app, at, on, kw in apps:
            runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout(),
                                   logger=server_log(), **kw)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, at, on, reuse_address=True, backlog=LISTEN_BACKLOG).start()
    except BaseException:
        await close()
        raise
    return close

