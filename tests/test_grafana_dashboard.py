"""Every expression in `deploy/grafana/batcher.json` names a metric the replica exports, with
labels it carries: scraped from a served request on the in-process server."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from batcher.engine.fake_runner import FakeSpeed
from batcher.server.appkeys import GATEWAY
from tests.test_diagnose import fake_app, send

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "batcher.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", ())]


async def test_every_expression_names_an_exported_metric(aiohttp_client) -> None:
    client = await aiohttp_client(fake_app(FakeSpeed(decode_step_s=0.001), slo_ttft_s=1.0,
                                           slo_tpot_s=0.1))
    await send(client, [300] * 40, 4)
    # A labelled counter shows its labels once it has a child: as after a refusal.
    client.app[GATEWAY].metrics.observe_rejected("queue_full")
    text = await (await client.get("/metrics")).text()
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        labels.setdefault(fam.name, set())
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
            labels[fam.name].update(s.labels)
    exprs = expressions()
    assert len(exprs) >= 10
    named: set[str] = set()
    for expr in exprs:
        names = re.findall(r"\bbatcher_[a-z0-9_]+", expr)
        assert names, expr
        carried: set[str] = {"le"}
        for name in names:
            base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
            assert name in labels or base in labels, f"{name} is not exported ({expr})"
            carried |= labels.get(name, set()) | labels.get(base, set())
            named.add(base)
        used = {x.strip() for group in re.findall(r"by \(([^)]*)\)", expr)
                for x in group.split(",")} | set(re.findall(r"\{(\w+)=", expr))
        assert used <= carried, f"{expr}: labels {used - carried} are not exported"
    # The latency anatomy is on the board: every phase, step kinds, the SLOs.
    for p in ("parse", "tokenize", "queue", "prefill", "decode", "post"):
        assert f"batcher_request_{p}_seconds" in named
    assert {"batcher_step_seconds", "batcher_step_tokens", "batcher_slo_seconds"} <= named


def test_a_misspelt_metric_would_be_caught() -> None:
    assert not any("batcher_ttft_second_" in e for e in expressions())
