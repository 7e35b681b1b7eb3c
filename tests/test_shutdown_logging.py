"""Stopping is logged as what it is: SIGTERM and Ctrl-C (SIGINT) each leave a line naming the
signal, and a router that is shutting down logs the replicas that stop with it at info, not as
evicted with a warning."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from batcher.fleet.router.health import HealthChecker, HealthConfig
from batcher.fleet.launcher import wait_for_signal
from batcher.fleet.router.registry import Registry


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_is_logged(caplog, sig: signal.Signals) -> None:
    caplog.set_level(logging.INFO, logger="batcher.fleet")
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(wait_for_signal())
    try:
        await asyncio.sleep(0.01)  # the handlers are installed
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(waiting, 5)
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)
    assert f"received {sig.name}: shutting down" in caplog.text


async def test_a_closing_router_logs_its_replicas_stopping_not_evicted(caplog) -> None:
    caplog.set_level(logging.INFO, logger="batcher.fleet")
    registry = Registry()
    first, second = (registry.add_static(f"http://127.0.0.1:{p}") for p in (9001, 9002))
    health = HealthChecker(registry, HealthConfig(), None,  # type: ignore[arg-type]
                           on_evict=lambda rep, why: None, on_readmit=lambda rep: None)
    # Running: a replica whose port refuses connections is evicted, with a warning.
    health.report_failure(first, "connection refused", conclusive=True)
    (evicted,) = [r for r in caplog.records if "evicted" in r.getMessage()]
    assert evicted.levelno == logging.WARNING
    caplog.clear()
    await health.close()  # the router is shutting down
    health.report_failure(second, "connection refused", conclusive=True)
    assert second.evicted  # out of rotation all the same
    (stopped,) = [r for r in caplog.records if second.replica_id in r.getMessage()]
    assert stopped.levelno == logging.INFO and "stopped with the router" in stopped.getMessage()
    assert "evicted" not in caplog.text
