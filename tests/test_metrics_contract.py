"""The metrics contract autoscalers and the inference gateway read: names, labels and meanings on a
fresh registry, and on `/metrics` of real processes (the fake model, then the bundled model at
default settings)."""

from __future__ import annotations

import re
import urllib.request

import orjson
import pytest

from batcher.engine.metrics import BusyWindow, Metrics
from tests.server_process import serve

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


@pytest.mark.slow
def test_metrics_contract_on_the_bundled_model() -> None:
    with serve("--model", "smollm2-135m", "--embedding-model", "none", num_blocks=None,
               ready_timeout=180.0) as srv:
        check_contract(srv.url, "smollm2-135m", None)
