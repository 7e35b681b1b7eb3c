"""`batcher diagnose --review`: configurations built to show each risk, ranked, with what is
right first; over HTTP from a replica's and a router's admin listener."""

from __future__ import annotations

import copy

import pytest

from batcher.app.diagnose import review_url
from batcher.fleet.router.admin import create_admin_app as router_admin
from batcher.fleet.router.context import RouterConfig, RouterContext
from batcher.app.review import review
from batcher.server.admin import create_admin_app
from batcher.tokenizer.tokenizer import load_tokenizer
from tests.test_gateway_inprocess import ADMIN_KEY, TENANTS, app_factory

GOOD = {"kind": "replica", "default_max_tokens": 1024, "deep_probe": True,
        "engine": {"max_num_seqs": 32, "max_model_len": 8192, "prefix_caching": True,
                   "prefix_cache_scope": "tenant"},
        "admission": {"slo_ttft_ms": 2000.0, "max_waiting": 64, "service_time_s": 4.0},
        "tenants": {"auth": True, "count": 3, "budgeted": 3}}


def with_(path: str, value: object) -> dict:
    cfg = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[last] = value
    return cfg


def test_a_sound_replica_leads_with_what_is_right_and_finds_nothing() -> None:
    rv = review(GOOD)
    assert rv.risks == []
    assert len(rv.right) >= 4 and rv.lines()[0].startswith("replica: what is right: ")
    with pytest.raises(ValueError):
        review({"kind": "other"})


@pytest.mark.parametrize(("path", "value", "risk"), [
    ("admission.slo_ttft_ms", None, "no SLO on admission"),
    ("admission.max_waiting", 4096, "queue bound far beyond what the SLO allows"),
    ("tenants.auth", False, "no tenant budgets (auth off)"),
    ("tenants.budgeted", 1, "tenants without token budgets"),
    ("engine.prefix_cache_scope", "global", "prefix cache shared across tenants"),
    ("default_max_tokens", 8192, "output caps missing"),
])
def test_each_replica_risk_is_found(path: str, value: object, risk: str) -> None:
    rv = review(with_(path, value))
    assert [r.title for r in rv.risks] == [risk]
    assert rv.risks[0].failure and rv.risks[0].fix


def test_the_three_highest_risks_are_ranked() -> None:
    cfg = with_("admission.slo_ttft_ms", None)
    cfg["engine"]["prefix_cache_scope"] = "global"
    cfg["tenants"]["auth"] = False
    cfg["default_max_tokens"] = 8192
    rv = review(cfg)
    assert [r.title for r in rv.top()] == ["no SLO on admission",
                                          "prefix cache shared across tenants",
                                          "no tenant budgets (auth off)"]
    assert rv.to_json()["more_risks"] is True and len(rv.to_json()["risks"]) == 3


def test_router_risks() -> None:
    good = {"kind": "router", "routing": "predicted-wait", "deep_probe": True,
            "retry": {"max_attempts": 3, "retry_ratio": 0.1}, "default_max_tokens": 16}
    assert review(good).risks == []
    bad = dict(good, routing="round-robin", deep_probe=False,
               retry={"max_attempts": 3, "retry_ratio": 0.0})
    assert [r.title for r in review(bad).top()] == [
        "round-robin routing", "no retry budget", "no deep probe"]


async def test_review_over_the_admin_listeners(aiohttp_client, tiny_fp32) -> None:
    public = app_factory(tiny_fp32, load_tokenizer(), TENANTS)()
    await aiohttp_client(public)  # starts the gateway
    admin = await aiohttp_client(create_admin_app(public, ADMIN_KEY))
    assert (await admin.get("/admin/config")).status == 401
    rv = await review_url(str(admin.make_url("")), ADMIN_KEY)
    assert rv.kind == "replica" and rv.risks[0].title == "no SLO on admission"
    assert "the prefix cache is scoped per tenant" in rv.right

    ctx = RouterContext(RouterConfig(routing="round-robin", admin_key="router-admin"))
    radmin = await aiohttp_client(router_admin(ctx, "router-admin"))
    rv = await review_url(str(radmin.make_url("")), "router-admin")
    assert [r.title for r in rv.top()][:2] == ["round-robin routing", "no deep probe"]
