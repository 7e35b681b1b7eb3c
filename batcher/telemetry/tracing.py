"""Optional OpenTelemetry traces (`--otlp-endpoint`, the `otel` extra): one span per request
with a child span per phase, in the trace the client's `traceparent` names. A router opens its
own span and forwards a `traceparent` naming it, so one trace spans router and replica.

Tracing is process-wide, as logging is: `configure` installs it once at start, and the request
paths ask `current()`. Without it (the default) nothing is recorded, and a router still forwards
the client's `traceparent` and `tracestate` unchanged."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from batcher.telemetry.timings import Timings

TRACE_HEADERS = ("traceparent", "tracestate")

try:  # an optional extra
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised where the extra is absent
    trace = None  # type: ignore[assignment]


class RequestTracer:
    """Spans for requests, built from their phase timings once the answer is out."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("batcher")
        self._prop = TraceContextTextMapPropagator()

    def _parent(self, headers: Mapping[str, str]) -> Any:
        carrier = {k: v for k in TRACE_HEADERS if (v := headers.get(k)) is not None}
        return self._prop.extract(carrier=carrier)

    def record(self, name: str, headers: Mapping[str, str], timings: Timings,
               attributes: dict[str, Any], ended_ns: int | None = None) -> None:
        """A finished request: its span, and one child per phase laid end to end."""
        end = time.time_ns() if ended_ns is None else ended_ns
        start = end - int(timings.total_ms * 1e6)
        span = self._tracer.start_span(name, context=self._parent(headers), start_time=start,
                                       attributes=attributes)
        inside = trace.set_span_in_context(span)
        t = start
        for phase, ms in timings.phases().items():
            nxt = t + int(ms * 1e6)
            self._tracer.start_span(phase, context=inside, start_time=t).end(end_time=nxt)
            t = nxt
        span.end(end_time=end)

    def open(self, name: str, headers: Mapping[str, str]) -> Any:
        """A span that runs while the router relays (ended with `span.end()`)."""
        return self._tracer.start_span(name, context=self._parent(headers))

    def inject(self, span: Any) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._prop.inject(carrier, context=trace.set_span_in_context(span))
        return carrier


class _State:
    """The process's tracer (None: tracing off)."""

    tracer: RequestTracer | None = None


def available() -> bool:
    return trace is not None


def configure(endpoint: str | None, service: str) -> RequestTracer | None:
    """Install OTLP/HTTP export to `endpoint` (e.g. http://collector:4318/v1/traces); None
    turns tracing off. A ValueError when the extra is not installed."""
    if not endpoint:
        _State.tracer = None
        return None
    if trace is None:
        raise ValueError("--otlp-endpoint needs the OpenTelemetry extra: "
                         "pip install 'batcher[otel]'")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return install(provider)


def install(provider: Any | None) -> RequestTracer | None:
    """Use `provider` (an SDK TracerProvider; tests pass one with an in-memory exporter)."""
    _State.tracer = None if provider is None else RequestTracer(provider)
    return _State.tracer


def current() -> RequestTracer | None:
    return _State.tracer


def forward_headers(client: Mapping[str, str], span: Any) -> dict[str, str]:
    """The trace headers a router sends upstream: its own span's when tracing, else the
    client's as they came."""
    tracer = _State.tracer
    if tracer is not None and span is not None:
        return tracer.inject(span)
    return {k: v for k in TRACE_HEADERS if (v := client.get(k)) is not None}
