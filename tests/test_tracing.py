"""OpenTelemetry (optional extra): one span per request with its phases as child spans, in the
client's trace; through a router, the router's span sits between the client and the replica.
Checked with the SDK's in-memory exporter."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

import itertools

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from batcher.telemetry import tracing
from batcher.app.cli import main
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.fleet.router.proxy import create_router_app
from batcher.telemetry.timings import PHASES
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory, auth, completion

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


async def test_one_trace_spans_client_router_and_replica(aiohttp_client, tiny_fp32, spans
                                                         ) -> None:
    replica = await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(replica.make_url("")).rstrip("/"))
    state = await (await replica.get("/v1/state")).json()
    assert ctx.registry.observe(rep.replica_id, state, ctx.clock())
    rep.ready = True
    router = await aiohttp_client(create_router_app(ctx))
    headers = auth(ALICE) | {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
                             "X-Request-Id": "traced-1"}
    r = await router.post("/v1/completions", json=completion(max_tokens=3), headers=headers)
    assert r.status == 200, await r.text()
    timings = (await r.json())["timings"]
    done = {s.name: s for s in spans.get_finished_spans()}
    routed, request = done["batcher.router"], done["batcher.request"]
    assert {f"{s.context.trace_id:032x}" for s in done.values()} == {TRACE_ID}
    assert f"{routed.parent.span_id:016x}" == CLIENT_SPAN
    assert request.parent.span_id == routed.context.span_id
    assert request.attributes["batcher.request_id"] == "traced-1"
    assert request.attributes["batcher.completion_tokens"] == 3
    children = sorted((s for s in spans.get_finished_spans()
                       if s.parent is not None and s.parent.span_id == request.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == list(PHASES)
    assert children[0].start_time == request.start_time
    assert children[-1].end_time == pytest.approx(request.end_time, abs=10_000)  # 10 us
    for a, b in itertools.pairwise(children):
        assert a.end_time == b.start_time
    decode = next(s for s in children if s.name == "decode")
    assert (decode.end_time - decode.start_time) / 1e6 == pytest.approx(
        timings["decode_ms"], abs=0.01)


async def test_without_tracing_the_router_forwards_the_clients_traceparent() -> None:
    assert tracing.current() is None
    h = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "other": "x"}
    assert tracing.forward_headers(h, None) == {"traceparent": h["traceparent"]}


def test_otlp_endpoint_installs_an_exporter_and_needs_the_extra(monkeypatch) -> None:
    tracer = tracing.configure("http://127.0.0.1:4318/v1/traces", "batcher-test")
    try:
        assert tracer is not None and tracing.current() is tracer
    finally:
        tracer.provider.shutdown()
        tracing.configure(None, "batcher-test")
    assert tracing.current() is None
    monkeypatch.setattr(tracing, "trace", None)
    with pytest.raises(ValueError, match="otel"):
        tracing.configure("http://127.0.0.1:4318/v1/traces", "batcher-test")
    assert main(["router", "--otlp-endpoint", "http://127.0.0.1:4318/v1/traces"]) == 2
