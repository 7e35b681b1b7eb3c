"""The replica's side of membership: POST its `/v1/state` to each router about once a second.

Wire contract (`POST {router}/internal/heartbeat`, `{router}` being the router's internal
listener): the state (`EngineSnapshot.to_wire()`) plus `replica_id`, `url`,
`epoch` and `seq`. `epoch` is an integer fixed per process start (boot time in microseconds
times 1000 plus a random remainder, so a restart is always newer and two starts never share
one); `seq` grows by one per beat. With `BATCHER_FLEET_KEY` in the environment the beat carries
`Authorization: Bearer KEY`. A router that does not answer within `timeout` is skipped until the
next beat; beats never block the replica's event loop for longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from batcher.engine.snapshot import EngineSnapshot

log = logging.getLogger("batcher.fleet.heartbeat")


def new_epoch() -> int:
    return (time.time_ns() // 1000) * 1000 + random.randrange(1000)


def beat_payload(state: dict[str, Any], replica_id: str, url: str, epoch: int, seq: int
                 ) -> dict[str, Any]:
    return dict(state, replica_id=replica_id, url=url, epoch=epoch, seq=seq)


async def heartbeat_loop(state_fn: Callable[[], EngineSnapshot], routers: Sequence[str],
                         replica_id: str, url: str, interval: float = 1.0,
                         timeout: float = 0.5, key: str | None = None,
                         admin_url: str | None = None) -> None:
    """Beat until cancelled. Failures are logged once per router until it answers again."""
    epoch, seq = new_epoch(), 0
    key = key or os.environ.get("BATCHER_FLEET_KEY")
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    targets = [r.rstrip("/") + "/internal/heartbeat" for r in routers]
    failing: set[str] = set()
    loop = asyncio.get_running_loop()

    async def send(session: aiohttp.ClientSession, target: str, body: bytes) -> None:
        try:
            async with session.post(target, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status >= 400:
                    # A 404 is most likely a router's public port: beats go to its internal one.
                    hint = " (is it the router's --internal-port?)" if resp.status == 404 else ""
                    raise RuntimeError(f"status {resp.status}{hint}")
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            if target not in failing:
                failing.add(target)
                log.warning("heartbeat to %s failed: %s", target, exc or type(exc).__name__)
            return
        if target in failing:
            failing.discard(target)
            log.info("heartbeat to %s works again", target)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        next_at = loop.time()
        while True:
            seq += 1
            payload = beat_payload(state_fn().to_wire(), replica_id, url, epoch, seq)
            if admin_url:
                payload["admin_url"] = admin_url  # lets the router drain a replica that joined
            body = orjson.dumps(payload)
            await asyncio.gather(*(send(session, t, body) for t in targets))
            # +-10% jitter keeps a fleet's beats from arriving in lockstep.
            next_at = max(next_at + interval * random.uniform(0.9, 1.1), loop.time())
            await asyncio.sleep(next_at - loop.time())
