"""The admin listener: drain and undrain, on its own port and key (never on the public one)."""

from __future__ import annotations

import hmac

from aiohttp import web

from batcher.futures import new_request_id
from batcher.server.errors import ApiError


def create_admin_app(public: web.Application, admin_key: str) -> web.Application:
    from batcher.server.app import GATEWAY, add_fallback_route, expect_continue, json_response

    expected = f"Bearer {admin_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        rid = new_request_id()
        # surrogateescape: header bytes that are not UTF-8 arrive as lone surrogates; they must
        # compare unequal, not raise (a 500).
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, expected):
            return ApiError(401, "invalid admin key", code="invalid_api_key").response(rid)
        try:
            resp = await handler(request)
        except ApiError as err:
            return err.response(rid)
        except web.HTTPException as exc:  # unknown admin route or method: OpenAI shape too
            if exc.status < 400:
                raise
            return ApiError(exc.status, exc.reason or "error",
                            code=(exc.reason or "error").lower().replace(" ", "_")
                            ).response(rid)
        resp.headers["X-Request-Id"] = rid
        return resp

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
        return json_response(dict(gw.state(), idle=not gw.jobs))

    app = web.Application(middlewares=[check_key])
    ex = {"expect_handler": expect_continue}
    app.router.add_post("/admin/drain", drain, **ex)
    app.router.add_post("/admin/undrain", undrain, **ex)
    app.router.add_get("/admin/status", status, **ex)
    add_fallback_route(app)
    return app
