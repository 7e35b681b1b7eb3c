"""Prometheus metrics. Queue wait is split from service time; goodput counts requests that met
both latency SLOs. Each server owns its own registry (several can live in one process)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from batcher.core.outputs import SchedulerOutput
from batcher.core.step_updates import SchedulerStats
from batcher.engine.snapshot import EngineSnapshot
from batcher.core.request import Priority
from batcher.telemetry.timings import PHASES, Timings

if TYPE_CHECKING:  # the engine imports this module; its event type is only annotated here
    from batcher.engine.events import EngineEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                1, 2, 5)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def priority_label(priority: int) -> str:
    """The class a request's priority falls in (integer priorities at or past batch are batch)."""
    return "batch" if priority >= Priority.BATCH else "interactive"


def step_kind(sched: SchedulerOutput) -> str:
    """`decode` (one token per row), `prefill` (prompt chunks only) or `mixed`."""
    if sched.num_decodes == len(sched.seqs):
        return "decode"
    return "prefill" if sched.num_decodes == 0 else "mixed"


class Metrics:
    """The server's metrics (names carry the `batcher_` prefix when exposed)."""

    def __init__(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"batcher_{name}", doc, buckets=buckets, registry=r)

        def labelled(name: str, doc: str, labels: list[str], buckets=PHASE_BUCKETS
                     ) -> Histogram:
            return Histogram(f"batcher_{name}", doc, labels, buckets=buckets, registry=r)

        self.ttft = labelled("ttft_seconds", "Arrival to first token", ["priority"],
                             LATENCY_BUCKETS)
        self.tpot = hist("tpot_seconds", "Mean time per output token after the first",
                         TPOT_BUCKETS)
        self.queue_wait = labelled("queue_wait_seconds", "Arrival to first scheduled step",
                                   ["priority"], LATENCY_BUCKETS)
        # The latency anatomy, per phase, from HTTP receipt (see batcher.telemetry.timings).
        self.phases = {p: (labelled(f"request_{p}_seconds", f"Time in the {p} phase",
                                    ["priority"]) if p == "queue" else
                           hist(f"request_{p}_seconds", f"Time in the {p} phase", PHASE_BUCKETS))
                       for p in PHASES}
        self.request_total = hist("request_total_seconds", "HTTP receipt to answer written")
        # By API route (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`, ...: the app's
        # route patterns, `other` for an unknown path; never a raw path or an id), beside the
        # unlabelled series the dashboards read.
        self.requests_by_route = Counter("batcher_requests_by_route", "HTTP requests answered, "
                                         "by route and status (499: the client went away)",
                                         ["route", "status"], registry=r)
        self.request_by_route = labelled("request_by_route_seconds", "HTTP receipt to answer "
                                         "written, by route", ["route"], LATENCY_BUCKETS)
        self.step_time = labelled("step_seconds", "Model time of one engine step, by kind",
                                  ["kind"], STEP_BUCKETS)
        self.step_tokens = labelled("step_tokens", "Tokens computed in one engine step, by kind",
                                    ["kind"], STEP_TOKEN_BUCKETS)
        self.service = hist("service_seconds", "First scheduled step to finish")
        self.e2e = hist("e2e_seconds", "Arrival to finish")
        self.batch_size = hist("batch_size", "Sequences per engine step", BATCH_BUCKETS)
        self.cancel_delay = hist("cancel_delay_seconds", "Abort to KV blocks freed")
        self.kv_used = Gauge("batcher_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("batcher_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.running = Gauge("batcher_running", "Running sequences", registry=r)
        self.waiting = Gauge("batcher_waiting", "Waiting sequences", registry=r)
        self.prompt_tokens = Counter("batcher_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generated_tokens = Counter("batcher_generated_tokens", "Tokens generated",
                                        registry=r)
        self.prefill_computed = Counter("batcher_prefill_tokens_computed",
                                        "Prompt positions run through the model (recompute "
                                        "included)", registry=r)
        self.prefix_hits = Counter("batcher_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache", registry=r)
        self.preemptions = Counter("batcher_preemptions", "Requests preempted for recompute",
                                   registry=r)
        self.spec_drafted = Counter("batcher_spec_draft_tokens", "Tokens drafted by "
                                    "speculative decoding and checked by the model", registry=r)
        self.spec_accepted = Counter("batcher_spec_accepted_tokens", "Drafted tokens the model "
                                     "agreed with (each saves a decode step)", registry=r)
        self.finished = Counter("batcher_requests_finished", "Requests finished",
                                ["reason"], registry=r)
        self.rejected = Counter("batcher_requests_rejected", "Requests refused before the "
                                "engine", ["reason"], registry=r)
        # What refused clients were told: how long to stay away (`batcher diagnose` reports
        # it beside the refused share).
        self.retry_after = Histogram("batcher_retry_after_seconds", "Retry-After given with "
                                     "refusals", buckets=(1, 2, 5, 10, 30, 60, 300),
                                     registry=r)
        self.goodput = Counter("batcher_goodput_requests", "Requests finished within both the "
                               "TTFT and the TPOT SLO", registry=r)
        self.info = Gauge("batcher_info", "Server identity", ["version", "model"], registry=r)
        # The configured SLOs, so a reader of /metrics (`batcher diagnose`, a dashboard) can
        # judge latencies against them without the server's flags.
        self.slo = Gauge("batcher_slo_seconds", "Configured latency SLO", ["kind"], registry=r)
        for kind, value in (("ttft", slo_ttft_s), ("tpot", slo_tpot_s)):
            if value is not None:
                self.slo.labels(kind).set(value)
        # Leak watch (the soak test): tasks on the event loop, counted when scraped; and the
        # standard process_* series (open fds, resident memory, CPU), where the OS offers them.
        self.asyncio_tasks = Gauge("batcher_asyncio_tasks", "Tasks alive on the event loop",
                                   registry=r)
        self.asyncio_tasks.set_function(_count_tasks)
        self._contract()
        if registry is None:
            ProcessCollector(registry=r)
        self._last: dict[str, int] = {}

    def exposition(self) -> bytes:
        """The text format; call it on the event loop (the task gauge counts that loop)."""
        return generate_latest(self.registry)

    # engine hooks ----------------------------------------------------------------------------
    def observe_step(self, stats: SchedulerStats, batch_size: int) -> None:
        """After each step: its batch size and the scheduler's running totals (counters advance
        by the difference since the last step)."""
        self.batch_size.observe(batch_size)
        st = stats
        for name, counter in (("generated_tokens", self.generated_tokens),
                              ("prompt_tokens_computed", self.prefill_computed),
                              ("prefix_hit_tokens", self.prefix_hits),
                              ("preemptions", self.preemptions),
                              ("spec_draft_tokens", self.spec_drafted),
                              ("spec_accepted_tokens", self.spec_accepted)):
            value = getattr(st, name)
            delta = value - self._last.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            self._last[name] = value

    def observe_state(self, snap: EngineSnapshot) -> None:
        """The engine's state gauges from its snapshot (the engine calls this after steps, at a
        bounded rate, and when it goes idle)."""
        self.kv_total.set(snap.total_blocks)
        self.kv_used.set(snap.used_blocks)
        self.running.set(snap.running)
        self.waiting.set(snap.waiting)
        self._observe_contract(snap)

    def observe_finished(self, ev: EngineEvent) -> None:
        self.finished.labels(ev.finish_reason).inc()
        self.prompt_tokens.inc(ev.num_prompt_tokens)
        prio = priority_label(ev.priority)
        if ev.queue_wait is not None:
            self.queue_wait.labels(prio).observe(ev.queue_wait)
            if ev.e2e is not None:
                self.service.observe(max(0.0, ev.e2e - ev.queue_wait))
        if ev.e2e is not None:
            self.e2e.observe(ev.e2e)
        if ev.ttft is not None:
            self.ttft.labels(prio).observe(ev.ttft)
        tpot = ev.tpot
        if tpot is not None:
            self.tpot.observe(tpot)
        if ev.finish_reason in ("stop", "length") and self.met_slo(ev.ttft, tpot):
            self.goodput.inc()
            self._goodput_n += 1

    def met_slo(self, ttft: float | None, tpot: float | None) -> bool:
        if ttft is None:
            return False
        if self.slo_ttft_s is not None and ttft > self.slo_ttft_s:
            return False
        return not (self.slo_tpot_s is not None and tpot is not None and tpot > self.slo_tpot_s)

    def observe_step_shape(self, sched: SchedulerOutput, seconds: float) -> None:
        kind = step_kind(sched)
        self.step_time.labels(kind).observe(seconds)
        self._busy.add(time.monotonic(), seconds)
        self.step_tokens.labels(kind).observe(sum(len(s.token_ids) for s in sched.seqs))

    def observe_phases(self, t: Timings, priority: int, route: str | None = None) -> None:
        """One answered generation request's phases (see batcher.telemetry.timings), and its
        total under its `route` (a route pattern, never a raw path) when given."""
        for p, ms in t.phases().items():
            h = self.phases.get(p)
            if h is None:
                continue
            (h.labels(priority_label(priority)) if p == "queue" else h).observe(ms / 1000.0)
        self.request_total.observe(t.total_ms / 1000.0)
        if route is not None:
            self.request_by_route.labels(route).observe(t.total_ms / 1000.0)

    def observe_request(self, route: str, status: str) -> None:
        """Any HTTP request, once answered (`batcher.http.middleware.count_requests`)."""
        self.requests_by_route.labels(route, status).inc()

    # the autoscaler / inference-gateway contract --------------------------------------------
    def _contract(self) -> None:
        """Gauges KEDA, an HPA (through a Prometheus adapter) and the Gateway API Inference
        Extension read as they are: exported from start (at 0 until the first step) under the
        `model_name` label `configure` sets."""
        r = self.registry
        self.model_name = "unknown"
        self.kv_usage = Gauge("batcher_kv_cache_usage_ratio", "KV cache blocks in use, 0-1",
                              ["model_name"], registry=r)
        self.waiting_tokens = Gauge("batcher_waiting_tokens", "Prompt tokens accepted and not "
                                    "yet prefilled", ["model_name"], registry=r)
        self.queue_wait_predicted = Gauge(
            "batcher_predicted_queue_wait_seconds", "Seconds to prefill the unserved prompt "
            "tokens at the measured prefill rate (a new request's queue wait)", ["model_name"],
            registry=r)
        self.busy = Gauge("batcher_engine_busy_ratio", "Share of the last minute the engine "
                          "spent in model steps, 0-1", ["model_name"], registry=r)
        self.goodput_rate = Gauge("batcher_goodput_requests_per_replica_hour", "Requests "
                                  "within both SLOs per hour this replica has run",
                                  ["model_name"], registry=r)
        self.cache_config = Gauge("batcher_cache_config_info", "KV cache configuration",
                                  ["model_name", "block_size", "num_blocks", "max_num_seqs"],
                                  registry=r)
        self._busy = BusyWindow()
        self._goodput_n = 0
        self._started = time.monotonic()
        self._prefill_rate: Callable[[], float | None] = lambda: None
        self._label_contract()

    def _label_contract(self) -> None:
        m = self.model_name
        for g in (self.kv_usage, self.waiting_tokens, self.queue_wait_predicted):
            g.labels(m).set(0)
        self.busy.labels(m).set_function(lambda: self._busy.ratio(time.monotonic()))
        self.goodput_rate.labels(m).set_function(
            lambda: self._goodput_n * 3600.0 / max(1.0, time.monotonic() - self._started))

    def configure(self, model_name: str, block_size: int, num_blocks: int, max_num_seqs: int,
                  prefill_rate: Callable[[], float | None] | None = None) -> None:
        """Name the model and the cache once the engine is built (before the server is ready).
        `prefill_rate`: the measured prompt tokens per second (None until measured)."""
        for g in (self.kv_usage, self.waiting_tokens, self.queue_wait_predicted, self.busy,
                  self.goodput_rate):
            g.clear()
        self.model_name = model_name
        self.cache_config.clear()
        self.cache_config.labels(model_name, str(block_size), str(num_blocks),
                                 str(max_num_seqs)).set(1)
        if prefill_rate is not None:
            self._prefill_rate = prefill_rate
        self._label_contract()

    def _observe_contract(self, snap: EngineSnapshot) -> None:
        m = self.model_name
        if snap.total_blocks > 0:
            self.kv_usage.labels(m).set(snap.used_blocks / snap.total_blocks)
        tokens = snap.unserved_prefill_tokens
        self.waiting_tokens.labels(m).set(tokens)
        rate = self._prefill_rate()
        self.queue_wait_predicted.labels(m).set(tokens / rate if rate else 0.0)

    def observe_cancel_delay(self, seconds: float) -> None:
        self.cancel_delay.observe(seconds)

    def observe_rejected(self, reason: str, retry_after: float | None = None) -> None:
        self.rejected.labels(reason).inc()
        if retry_after is not None:
            self.retry_after.observe(retry_after)


class BusyWindow:
    """Model seconds over the last `window` seconds of wall time (the engine's occupancy); a
    replica up for less than the window is judged over its uptime."""

    __slots__ = ("_started", "_steps", "_sum", "window")

    def __init__(self, window: float = 60.0, started: float | None = None):
        self.window = window
        self._started = time.monotonic() if started is None else started
        self._steps: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, now: float, seconds: float) -> None:
        self._steps.append((now, seconds))
        self._sum += seconds
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window:
            self._sum -= self._steps.popleft()[1]

    def ratio(self, now: float) -> float:
        self._prune(now)
        span = min(self.window, now - self._started)
        return min(1.0, max(0.0, self._sum / span)) if span > 0 else 0.0


def _count_tasks() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # scraped outside a running loop
        return 0.0
