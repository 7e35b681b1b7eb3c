"""The admin listener: drain and undrain, on its own port and key (never on the public one)."""

from __future__ import annotations

from aiohttp import web

from batcher.http.listener import add_fallback_route, expect_continue
from batcher.http.middleware import answer_errors, require_bearer
from batcher.http.responses import json_response
from batcher.server.appkeys import GATEWAY


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def create_admin_app(public: web.Application, admin_key: str) -> web.Application:
    async def drain(request: web.Request) -> web.Response:
        gw = public[GATEWAY]
        gw.set_draining(True)
        return json_response({"draining": True, "in_flight": len(gw.jobs),
                              "idle": not gw.jobs})

    async def undrain(request: web.Request) -> web.Response:
        public[GATEWAY].set_draining(False)
        return json_response({"draining": False})

    async def config(request: web.Request) -> web.Response:
        """The effective configuration, for `batcher diagnose --review` (no keys in it)."""
        gw = public[GATEWAY]
        adm = gw.admission
        tenants = list((adm.tenants or {}).values())
        return json_response({
            "kind": "replica", "model": gw.cfg.model_name, "engine": gw.engine.settings(),
            "default_max_tokens": gw.cfg.default_max_tokens,
            "admission": {"slo_ttft_ms": _ms(adm.slo_ttft_s), "slo_tpot_ms": _ms(adm.slo_tpot_s),
                          "max_waiting": adm.max_waiting, "batch_share": adm.batch_share,
                          "service_time_s": adm.service_time_s},
            "tenants": {"auth": bool(tenants), "count": len(tenants),
                        "budgeted": sum(1 for t in tenants if not t.unlimited)},
            "deep_probe": True})

    async def status(request: web.Request) -> web.Response:
        gw = public[GATEWAY]
        return json_response(dict(gw.state().to_wire(), idle=not gw.jobs))

    app = web.Application(middlewares=[answer_errors,
                                       require_bearer(admin_key, "invalid admin key")])
    ex = {"expect_handler": expect_continue}
    app.router.add_post("/admin/drain", drain, **ex)
    app.router.add_post("/admin/undrain", undrain, **ex)
    app.router.add_get("/admin/status", status, **ex)
    app.router.add_get("/admin/config", config, **ex)
    add_fallback_route(app)
    return app
