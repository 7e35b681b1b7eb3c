"""Real processes on 127.0.0.1 for the fleet tests: fake replicas and routers, each stopped by the
test that started it (SIGCONT first, then SIGTERM, then SIGKILL). Their logs go to temporary
files, removed on stop unless FLEET_KEEP_LOGS is set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from batcher.fleet.launcher import free_port as launcher_free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key"
# Every router and replica here shares it: heartbeats are authenticated, as in production.
FLEET_KEY = "test-fleet-key"
FLEET = {"Authorization": f"Bearer {FLEET_KEY}"}
FAKE = ["--model", "fake", "--embedding-model", "none", "--log-level", "warning"]


def free_port() -> int:
    return launcher_free_port("127.0.0.1")


# What a stub replica reports on /v1/state: healthy, idle, plenty of KV.
STUB_STATE = {"free_blocks": 500, "total_blocks": 500, "block_size": 16, "running": 0,
              "waiting": 0, "version": "v1", "draining": False, "healthy": True}


async def start_stub_replica(completions: Callable[[web.Request], Awaitable[web.Response]]
                             | None = None, port: int | None = None,
                             routes: Iterable[tuple[str, str, Callable[[web.Request],
                                                                       Awaitable[Any]]]] = ()
                             ) -> tuple[web.AppRunner, str]:
    """An in-process replica double on 127.0.0.1: healthy and ready, STUB_STATE on /v1/state,
    `completions` answering /v1/completions and each (method, path, handler) of `routes` its
    own. The caller stops it with `runner.cleanup()`."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def state(request: web.Request) -> web.Response:
        return web.json_response(STUB_STATE)

    app = web.Application()
    for path in ("/health", "/ready"):
        app.router.add_get(path, ok)
    app.router.add_post("/v1/probe", ok)
    app.router.add_get("/v1/state", state)
    if completions is not None:
        app.router.add_post("/v1/completions", completions)
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


class Proc:
    """One child process with its log in a temporary file."""

    def __init__(self, argv: list[str], port: int, name: str, admin_port: int | None = None,
                 internal_port: int | None = None, env: dict[str, str] | None = None):
        self.port, self.name, self.admin_port = port, name, admin_port
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}" if admin_port else None
        # A router's heartbeat listener (the replicas' `--router`).
        self.internal_url = f"http://127.0.0.1:{internal_port}" if internal_port else None
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed by stop())
            prefix=f"fleet-{name}-", suffix=".log", delete=False)
        env = {**os.environ, "BATCHER_ADMIN_KEY": ADMIN_KEY, "BATCHER_FLEET_KEY": FLEET_KEY,
               "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.p.pid

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.p.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.p.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        if not os.environ.get("FLEET_KEEP_LOGS"):
            Path(self.log.name).unlink(missing_ok=True)
        return self.p.returncode

    def tail(self, n: int = 3000) -> str:
        path = Path(self.log.name)
        return path.read_text(errors="replace")[-n:] if path.exists() else ""


def replica(name: str, *flags: str, port: int | None = None, router: str | None = None,
            decode_ms: float = 5.0, num_blocks: int = 512, admin: bool = True) -> Proc:
    port = port or free_port()
    admin_port = free_port() if admin else None
    argv = ["-m", "batcher.app.cli", "serve", *FAKE, "--port", str(port), "--num-blocks",
            str(num_blocks), "--fake-decode-step-ms", str(decode_ms), "--replica-id", name,
            "--shutdown-timeout", "3", *flags]
    if admin_port:
        argv += ["--admin-port", str(admin_port)]
    if router:
        argv += ["--router", router]
    return Proc(argv, port, name, admin_port)


def router(*flags: str, replicas: tuple[Proc | str, ...] = (), port: int | None = None,
           env: dict[str, str] | None = None) -> Proc:
    port = port or free_port()
    admin_port, internal_port = free_port(), free_port()
    argv = ["-m", "batcher.app.fleet_cli", "router", "--port", str(port), "--admin-port",
            str(admin_port), "--admin-key", ADMIN_KEY, "--replica-admin-key", ADMIN_KEY,
            "--internal-port", str(internal_port), "--log-level", "warning",
            "--shutdown-timeout", "2", *flags]
    for r in replicas:
        if isinstance(r, str):
            argv += ["--replica", r]
        else:
            argv += ["--replica", f"{r.url},{r.admin_url}" if r.admin_url else r.url]
    return Proc(argv, port, "router", admin_port, internal_port, env)


def wait_http(url: str, timeout: float = 40.0, procs: tuple[Proc, ...] = ()) -> None:
    """Until `url` answers 200 (blocking; for fixtures)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.p.poll() is not None:
                raise RuntimeError(f"{p.name} exited early:\n{p.tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not up in {timeout}s")


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[tuple[Proc, ...]]:
    """Stop every process at the end, whatever happens."""
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


async def admin(session: aiohttp.ClientSession, r: Proc, path: str,
                body: dict[str, Any] | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    method = session.post if body is not None else session.get
    kw: dict[str, Any] = {"data": orjson.dumps(body)} if body is not None else {}
    # The admin listener may come up a moment after the public one; retry connects briefly.
    for attempt in range(50):
        try:
            async with method(f"{r.admin_url}{path}", headers=headers, **kw) as resp:
                return orjson.loads(await resp.read())
        except aiohttp.ClientConnectorError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def replica_view(session: aiohttp.ClientSession, r: Proc, replica_id: str
                       ) -> dict[str, Any]:
    st = await admin(session, r, "/admin/status")
    return next(x for x in st["replicas"] if x["replica_id"] == replica_id)


async def wait_routable(session: aiohttp.ClientSession, r: Proc, n: int,
                        timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            st = await admin(session, r, "/admin/status")
        except aiohttp.ClientConnectionError:  # the admin listener may start a moment later
            await asyncio.sleep(0.1)
            continue
        if sum(x["routable"] for x in st["replicas"]) >= n:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"fewer than {n} routable replicas: {st}")


async def completion(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                     rid: str | None = None, **extra: Any) -> tuple[int, dict[str, Any]]:
    headers = {"X-Request-Id": rid} if rid else {}
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                            headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                 rid: str | None = None, **extra: Any) -> tuple[int, list[Any]]:
    """Status and the parsed events (`"[DONE]"` for the end marker)."""
    headers = {"X-Request-Id": rid} if rid else {}
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                            headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, [orjson.loads(raw)]
    events: list[Any] = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: "):
            data = ev[6:]
            events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return 200, events


def stream_text(events: list[Any]) -> str:
    return "".join(ch.get("text", "") for e in events if isinstance(e, dict)
                   for ch in e.get("choices", ()))


async def router_samples(session: aiohttp.ClientSession, r: Proc, name: str
                         ) -> list[tuple[dict[str, str], float]]:
    """Samples of one router metric: (labels, value)."""
    async with session.get(f"{r.url}/metrics") as resp:
        text = (await resp.read()).decode()
    out = []
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            inner = head[len(name):].strip("{}")
            labels = dict(p.split("=", 1) for p in inner.split(",") if "=" in p)
            out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


async def served_by(session: aiohttp.ClientSession, r: Proc, outcome: str = "ok"
                    ) -> dict[str, float]:
    """Upstream attempts with `outcome`, by replica id."""
    out: dict[str, float] = {}
    for labels, v in await router_samples(session, r, "batcher_router_requests_total"):
        if labels.get("outcome") == outcome:
            out[labels["replica"]] = out.get(labels["replica"], 0.0) + v
    return out
