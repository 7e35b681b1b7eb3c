"""The router's own Prometheus registry (never the replicas' numbers; scrape those directly)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batcher.telemetry.timings import ROUTER_PHASES, Timings

PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                 20, 40, 80, 160)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
OUTCOMES = ("ok", "rejected", "error", "client_error", "cancelled", "resumed", "stream_error",
            "budget_exhausted", "no_replica")


class RouterMetrics:
    """Names carry the `batcher_router_` prefix, but `batcher_retries` and `batcher_failovers`
    (the names the metrics contract gives them; only a router retries or fails over); requests
    are labelled by replica, version and outcome so a canary's error rate can be compared with
    the stable version's."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("batcher_router_requests", "Upstream attempts by replica, "
                                "version and outcome", ["replica", "version", "outcome"],
                                registry=r)
        self.client_requests = Counter("batcher_router_client_requests", "Client requests by "
                                       "final outcome", ["outcome"], registry=r)
        # By API route (the router's route patterns, `other` for an unknown path; never a raw
        # path or an id) and the status the client got.
        self.requests_by_route = Counter("batcher_router_requests_by_route", "Client requests "
                                         "answered, by route and status (499: the client went "
                                         "away)", ["route", "status"], registry=r)
        self.retries = Counter("batcher_retries", "Retries before the first byte by reason: "
                               "capacity (a 503) and failure (another answer, a timeout) spend "
                               "the retry budget; replica_lost (it died or became unreachable) "
                               "is failover and spends none", ["reason"], registry=r)
        self.budget_exhausted = Counter("batcher_router_retry_budget_exhausted",
                                        "Retries refused by the fleet retry budget", registry=r)
        self.evictions = Counter("batcher_router_evictions", "Replicas evicted by health",
                                 ["replica"], registry=r)
        self.readmissions = Counter("batcher_router_readmissions", "Evicted replicas "
                                    "re-admitted", ["replica"], registry=r)
        self.failovers = Counter("batcher_failovers", "Failovers by kind: retry (before "
                                 "the first byte), resume, error (stream ended with an error)",
                                 ["kind"], registry=r)
        self.routing = Histogram("batcher_router_routing_seconds", "Time to pick a replica",
                                 buckets=ROUTING_BUCKETS, registry=r)
        self.inflight = Gauge("batcher_router_inflight", "Client requests in flight",
                              registry=r)
        self.beats = Counter("batcher_router_heartbeats", "Heartbeats by outcome: accepted, "
                             "stale, refused, invalid, unauthorized, rate_limited", ["outcome"],
                             registry=r)
        self.replicas = Gauge("batcher_router_replicas", "Replicas by router view",
                              ["view"], registry=r)
        # The latency anatomy as the router's clients see it: its own `route` phase and the
        # replicas' phases it forwarded (see batcher.telemetry.timings).
        self.phases = {p: Histogram(f"batcher_router_request_{p}_seconds",
                                    f"Time in the {p} phase, through the router",
                                    buckets=PHASE_BUCKETS, registry=r) for p in ROUTER_PHASES}
        # (version, outcome) pairs each replica's request series has, so a forgotten replica's
        # series can be removed (a flood of registrations must not grow /metrics for ever).
        self._attempted: dict[str, set[tuple[str, str]]] = {}
        self.request_total = Histogram("batcher_router_request_total_seconds", "Router "
                                       "receipt to answer relayed", buckets=PHASE_BUCKETS,
                                       registry=r)

    def observe_phases(self, t: Timings) -> None:
        for p, ms in t.phases().items():
            self.phases[p].observe(ms / 1000.0)
        self.request_total.observe(t.total_ms / 1000.0)

    def client_request(self, outcome: str) -> None:
        self.client_requests.labels(outcome).inc()

    def request_by_route(self, route: str, status: str) -> None:
        self.requests_by_route.labels(route, status).inc()

    def attempt(self, replica: str, version: str | None, outcome: str) -> None:
        version = version or "unknown"
        self._attempted.setdefault(replica, set()).add((version, outcome))
        self.requests.labels(replica, version, outcome).inc()

    def forget_replica(self, replica: str) -> None:
        """Remove every series labelled with a replica the registry forgot."""
        for version, outcome in self._attempted.pop(replica, ()):
            self.requests.remove(replica, version, outcome)
        self.evictions.remove(replica)
        self.readmissions.remove(replica)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
