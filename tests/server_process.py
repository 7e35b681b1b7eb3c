"""Run `batcher serve` as a real subprocess for the HTTP tests.

`serve(...)` starts the tiny random-weight model on 127.0.0.1 and a free port in its own process
group, waits until `GET /ready` answers 200, yields a `Server`, and always stops it (SIGTERM, then
SIGKILL if it does not exit in time). `server_fixture(...)` wraps that in a module-scoped pytest
fixture: starting a server costs a few seconds, so tests in one module share one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from batcher.fleet.launcher import free_port as launcher_free_port
from batcher.server.auth import hash_key

HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port for a server about to start (`batcher.fleet.launcher.free_port`)."""
    return launcher_free_port(HOST)


@dataclass(slots=True)
class Server:
    """One running `batcher serve` process."""

    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    admin_url: str | None = None
    admin_key: str | None = None

    def log(self) -> str:
        """Everything the server printed so far (stdout and stderr together)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the process group, wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
        return self.proc.wait(10)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # The server runs in its own session, so its process group id is its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# Loopback only: never route the readiness poll through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _ready_status(url: str) -> int | None:
    """The status of GET /ready, or None while nothing answers."""
    try:
        with _OPENER.open(url + "/ready", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


class _PortTaken(RuntimeError):
    """Another process bound the port between `free_port()` and the server's bind."""


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            log = server.log()
            if "address already in use" in log.lower():
                raise _PortTaken(log)
            raise RuntimeError(f"batcher serve exited with {server.proc.returncode} before it "
                               f"was ready; its log:\n{log}")
        if _ready_status(server.url) == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"batcher serve was not ready within {timeout:g}s; its log:\n"
                       f"{server.log()}")


@contextlib.contextmanager
def serve(*flags: str, num_blocks: int | None = 256, admin_key: str | None = None,
          shutdown_timeout: float = 5.0, ready_timeout: float = READY_TIMEOUT_S,
          env: dict[str, str] | None = None, check_log: bool = True) -> Iterator[Server]:
    """Start `batcher serve --model tiny` with `flags` and yield it once ready; stop it on exit.

    `admin_key` also opens the admin listener on its own free port (`Server.admin_url`). A short
    `shutdown_timeout` keeps teardown bounded if a test leaves a request running. `flags` come
    last, so `"--model", "fake"` among them replaces the tiny model. `check_log=False` skips the
    no-traceback check, for tests that inject a fault the server must log.
    """
    fd, log_name = tempfile.mkstemp(prefix="batcher-serve-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    try:
        server = _start(flags, num_blocks, admin_key, shutdown_timeout, ready_timeout, env,
                        log_path)
        try:
            yield server
        finally:
            server.stop()
        # Reached only when the body passed: then nothing a client sent may have raised in the
        # server (a traceback there is a 5xx or a dropped request waiting to happen).
        log = server.log()
        assert not check_log or "Traceback" not in log, (
            f"the server logged an exception:\n{log}")
    finally:
        log_path.unlink(missing_ok=True)


def _start(flags: Sequence[str], num_blocks: int | None, admin_key: str | None,
           shutdown_timeout: float, ready_timeout: float, env: dict[str, str] | None,
           log_path: Path, attempts: int = 3) -> Server:
    """Start the server and wait until it is ready; a fresh port on a lost port race."""
    for attempt in range(attempts):
        port = free_port()
        cmd = [sys.executable, "-m", "batcher.app.cli", "serve", "--model", MODEL,
               "--embedding-model", "none", "--host", HOST,
               "--port", str(port), "--shutdown-timeout", f"{shutdown_timeout:g}"]
        if num_blocks is not None:  # None: the KV pool sized as `batcher serve` sizes it
            cmd += ["--num-blocks", str(num_blocks)]
        admin_url = None
        if admin_key is not None:
            admin_port = free_port()
            cmd += ["--admin-port", str(admin_port), "--admin-key", admin_key]
            admin_url = f"http://{HOST}:{admin_port}"
        cmd += list(flags)
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        server = Server(f"http://{HOST}:{port}", port, proc, log_path, admin_url, admin_key)
        try:
            _wait_ready(server, ready_timeout)
        except _PortTaken:
            server.stop()
            if attempt + 1 == attempts:
                raise
            continue
        except BaseException:
            server.stop()
            raise
        return server
    raise AssertionError("unreachable")


def server_fixture(*flags: str,
                   setup: Callable[[pytest.TempPathFactory], Sequence[str]] | None = None,
                   scope: Any = "module", **kw: Any) -> Any:
    """A pytest fixture yielding a `Server` started with `flags` (plus whatever `setup` returns,
    e.g. a tenants file written under a temporary directory) and `serve`'s keyword options."""

    @pytest.fixture(scope=scope)
    def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
        extra = list(setup(tmp_path_factory)) if setup is not None else []
        with serve(*flags, *extra, **kw) as server:
            yield server

    return _server


def write_tenants(path: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    """Write a tenants TOML file. Each tenant's `key` (plain text) is stored as its SHA-256;
    every other field is written as given."""
    lines: list[str] = []
    for name, spec in tenants.items():
        fields = dict(spec)
        key = fields.pop("key")
        lines.append(f"[tenants.{name}]")
        lines.append(f'keys_sha256 = ["{hash_key(key)}"]')
        for field_name, value in fields.items():
            if isinstance(value, bool):
                rendered = "true" if value else "false"
            elif isinstance(value, list):
                rendered = "[" + ", ".join(f'"{v}"' for v in value) + "]"
            else:
                rendered = repr(value)
            lines.append(f"{field_name} = {rendered}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# HTTP helpers shared by the tests -------------------------------------------------------------

DONE = "[DONE]"
ERROR_FIELDS = {"message", "type", "param", "code"}


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The `data:` payloads of an SSE response, parsed as JSON; `DONE` for `[DONE]`, then stop."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == DONE:
            yield DONE
            return
        yield orjson.loads(data)


async def get_state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/v1/state") as resp:
        assert resp.status == 200
        return await resp.json()


async def wait_idle(session: aiohttp.ClientSession, url: str, within: float = 1.0
                    ) -> dict[str, Any]:
    """Poll /v1/state until every KV block is free and nothing runs or waits; fail after
    `within` seconds, showing the last state."""
    deadline = time.monotonic() + within
    while True:
        st = await get_state(session, url)
        if (st["free_blocks"] == st["total_blocks"] and st["running"] == 0
                and st["waiting"] == 0):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle within {within:g}s: {st}")
        await asyncio.sleep(0.02)


async def wait_state(session: aiohttp.ClientSession, url: str,
                     pred: Callable[[dict[str, Any]], bool], within: float = 10.0
                     ) -> dict[str, Any]:
    """Poll /v1/state until `pred(state)` holds; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        st = await get_state(session, url)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"state condition not reached within {within:g}s: {st}")
        await asyncio.sleep(0.02)


def assert_error_shape(body: Any) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}; returns the inner
    object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and ERROR_FIELDS <= set(err), body
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    return err


async def raw_http(url: str, request: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    """Send `request` bytes as they are (for what HTTP clients refuse to send, such as header
    values that are not UTF-8) on a new connection; return the status and the body."""
    host, _, port = url.removeprefix("http://").partition(":")
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(request)
            await writer.drain()
            data = await reader.read()  # the request says Connection: close
        finally:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
