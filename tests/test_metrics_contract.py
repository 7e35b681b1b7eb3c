"""The metrics contract autoscalers and the inference gateway read: names, labels and meanings on a
fresh registry, and on `/metrics` of real processes (the fake model here; the bundled model at
default settings in `test_agent_api_docs.py`, whose `batcher serve` it shares); requests counted
by route."""

from __future__ import annotations

import re
import urllib.request

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batcher.engine.fake_runner import FakeSpeed
from batcher.engine.metrics import BusyWindow, Metrics
from tests.server_process import serve
from tests.test_diagnose import fake_app
from tests.test_gateway_inprocess import ALICE

CONTRACT = ("batcher_kv_cache_usage_ratio", "batcher_waiting", "batcher_running",
            "batcher_waiting_tokens", "batcher_predicted_queue_wait_seconds",
            "batcher_engine_busy_ratio", "batcher_goodput_requests_per_replica_hour",
            "batcher_cache_config_info")


def samples(text: str, name: str) -> dict[str, float]:
    """Label text (`{...}` or "") -> value for one metric name."""
    out = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def labelled(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Sorted (label, value) pairs -> value for one sample name (label values may hold any
    character: a route pattern's braces)."""
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name}


def test_fresh_registry_exports_the_contract_at_zero() -> None:
    m = Metrics()
    text = m.exposition().decode()
    assert samples(text, "batcher_kv_cache_usage_ratio") == {'{model_name="unknown"}': 0.0}
    m.configure("smol", 16, 1024, 32, prefill_rate=lambda: 1000.0)
    text = m.exposition().decode()
    assert samples(text, "batcher_kv_cache_usage_ratio") == {'{model_name="smol"}': 0.0}
    assert samples(text, "batcher_cache_config_info") == {
        '{block_size="16",max_num_seqs="32",model_name="smol",num_blocks="1024"}': 1.0}
    assert samples(text, "batcher_engine_busy_ratio") == {'{model_name="smol"}': 0.0}


def test_busy_window() -> None:
    w = BusyWindow(window=10.0, started=0.0)
    w.add(1.0, 0.5)
    assert w.ratio(2.0) == pytest.approx(0.25)  # up 2 s, 0.5 s of it in steps
    for t in range(2, 12):
        w.add(float(t), 1.0)
    assert w.ratio(11.0) == pytest.approx(1.0)
    assert w.ratio(30.0) == 0.0  # the window moved past every step


async def test_requests_by_route(aiohttp_client) -> None:
    """Every request is counted under its route's pattern (an unknown path as `other`: never a
    raw path or an id) and its status; admitted generations also time their route. The series
    the dashboards read keep their labels."""
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.001)))
    key = {"Authorization": f"Bearer {ALICE}"}
    short = {"model": "fake", "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "Hi"}]}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]})):
        resp = await client.post(path, json={**short, **body}, headers=key)
        assert resp.status == 200, await resp.text()
    assert (await client.get("/v1/responses/resp_secret123", headers=key)).status == 404
    assert (await client.post("/v1/no/such/path/abc", headers=key)).status == 404
    assert (await client.post("/v1/messages", json={}, headers={"x-api-key": "bad"})
            ).status == 401
    text = (await (await client.get("/metrics")).text())
    assert labelled(text, "batcher_requests_by_route_total") == {
        (("route", route), ("status", status)): 1.0 for route, status in (
            ("/v1/completions", "200"), ("/v1/chat/completions", "200"),
            ("/v1/responses", "200"), ("/v1/messages", "200"), ("/v1/responses/{id}", "404"),
            ("other", "404"), ("/v1/messages", "401"))}
    assert labelled(text, "batcher_request_by_route_seconds_count") == {
        (("route", r),): 1.0 for r in ("/v1/completions", "/v1/chat/completions",
                                       "/v1/responses", "/v1/messages")}
    assert samples(text, "batcher_request_total_seconds_count") == {"": 4.0}
    assert set(samples(text, "batcher_ttft_seconds_count")) == {'{priority="interactive"}'}
    assert "secret123" not in text and "/v1/no/" not in text


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def complete(url: str, tokens: int) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=orjson.dumps(
        {"prompt": "The capital of France is", "max_tokens": tokens, "temperature": 0}),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return orjson.loads(resp.read())


def check_contract(url: str, model: str, num_blocks: int | None) -> None:
    before = scrape(url)
    for name in CONTRACT:
        assert samples(before, name), f"{name} missing from /metrics"
    label = f'{{model_name="{model}"}}'
    assert samples(before, "batcher_kv_cache_usage_ratio") == {label: 0.0}
    (info,) = samples(before, "batcher_cache_config_info")
    assert f'model_name="{model}"' in info and "max_num_seqs=" in info
    if num_blocks is not None:
        assert f'num_blocks="{num_blocks}"' in info
    assert complete(url, 4)["usage"]["completion_tokens"] == 4
    after = scrape(url)
    assert 0.0 < samples(after, "batcher_engine_busy_ratio")[label] <= 1.0
    assert samples(after, "batcher_waiting") == {"": 0.0}
    assert samples(after, "batcher_goodput_requests_per_replica_hour")[label] >= 0.0


def test_metrics_contract_on_the_fake_model() -> None:
    with serve("--model", "fake", "--embedding-model", "none", num_blocks=256) as srv:
        check_contract(srv.url, "fake", 256)
