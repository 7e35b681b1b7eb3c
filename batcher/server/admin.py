"""The admin listener: drain and undrain, on its own port and key (never on the public one)."""

from __future__ import annotations

from aiohttp import web

from batcher.http.listener import add_fallback_route, expect_continue
from batcher.http.middleware import answer_errors, require_bearer
from batcher.http.responses import json_response
from batcher.server.appkeys import GATEWAY


def create_admin_app(public: web.Application, admin_key: str) -> web.Application:
    async def drain(request: web.Request) -> web.Response:
        gw = public[GATEWAY]
        gw.set_draining(True)
        return json_response({"draining": True, "in_flight": len(gw.jobs),
                              "idle": not gw.jobs})

    async def undrain(request: web.Request) -> web.Response:
        public[GATEWAY].set_draining(False)
        return json_response({"draining": False})

    async def status(request: web.Request) -> web.Response:
        gw = public[GATEWAY]
        return json_response(dict(gw.state().to_wire(), idle=not gw.jobs))

    app = web.Application(middlewares=[answer_errors,
                                       require_bearer(admin_key, "invalid admin key")])
    ex = {"expect_handler": expect_continue}
    app.router.add_post("/admin/drain", drain, **ex)
    app.router.add_post("/admin/undrain", undrain, **ex)
    app.router.add_get("/admin/status", status, **ex)
    add_fallback_route(app)
    return app
