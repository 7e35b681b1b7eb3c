"""Engine faults injected into the fake model.

`error`: the model raises mid-batch. Pass figures: every in-flight caller, running or
queued, gets an explicit error (a whole answer: a 5xx JSON error in OpenAI's shape; a stream: an
error event, then [DONE]); `/ready` turns 503 and `/health` says why; new work is refused at once;
nothing hangs; the process stops cleanly and a restarted one serves.

`hang`: the model never returns. The deep probe (`POST /v1/probe?timeout=1`) reports the failure
within its deadline, and SIGTERM still stops the process, failing the stuck request explicitly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from batcher.engine.engine import STOP_GRACE_SECONDS
from tests.reliability.conftest import FAKE, stream_request
from tests.server_process import assert_error_shape, get_state, serve, wait_state

FAULT_STEPS = 30
# SLO admission off: on a loaded machine it may refuse some of the twelve requests sent at once
# (a 503 for a predicted TTFT), and this test is about what happens to those it took.
ERROR_FLAGS = (*FAKE, "--fake-decode-step-ms", "10", "--max-num-seqs", "4", "--slo-ttft-ms", "0",
               "--fake-fault", "error", "--fake-fault-after-steps", str(FAULT_STEPS))
FAULT_TEXT = "injected model fault"
# The deep probe is an operator's tool: it needs the replica's admin or fleet key.
PROBE_ENV = {"BATCHER_FLEET_KEY": "engine-fault-fleet-key"}
PROBE = {"Authorization": f"Bearer {PROBE_ENV['BATCHER_FLEET_KEY']}"}


async def whole(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
                ) -> tuple[int, Any, dict[str, str]]:
    async with session.post(url + path, json=body) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_model_error_fails_every_caller_then_restart_serves() -> None:
    with serve(*ERROR_FLAGS, check_log=False, env=PROBE_ENV) as server:
        url = server.url
        async with aiohttp.ClientSession() as session:
            long = {"model": "fake", "prompt": "a long answer please", "max_tokens": 500,
                    "ignore_eos": True}
            chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 500, "ignore_eos": True}
            # 4 run at once, 8 queue behind them: the fault hits both kinds.
            async with asyncio.timeout(15):  # nothing may hang
                results = await asyncio.gather(
                    *(stream_request(session, url, long, tag="stream") for _ in range(6)),
                    *(whole(session, url, "/v1/completions", long) for _ in range(3)),
                    *(whole(session, url, "/v1/chat/completions", chat) for _ in range(3)))
            streams, answers = results[:6], results[6:]
            for out in streams:
                # Either refused with a status before the first byte, or an error event mid-way.
                assert (out.status == 200 and out.error and FAULT_TEXT in out.error
                        and not out.done) or out.status == 503, out
            for status, body, _ in answers:
                assert status == 503, body
                err = assert_error_shape(body)
                assert FAULT_TEXT in err["message"] and err["code"] == "engine_error"

            async with session.get(url + "/ready") as resp:
                assert resp.status == 503
                assert FAULT_TEXT in (await resp.json())["reason"]
            async with session.get(url + "/health") as resp:
                assert resp.status == 503
                health = await resp.json()
                assert health["status"] == "error" and FAULT_TEXT in health["error"]
            st = await get_state(session, url)
            assert not st["healthy"] and st["in_flight"] == 0
            # New work is refused at once, with a reason and a Retry-After.
            start = time.monotonic()
            status, body, headers = await whole(session, url, "/v1/completions", long)
            assert status == 503 and "Retry-After" in headers and FAULT_TEXT in str(body)
            assert time.monotonic() - start < 1.0
            async with session.post(url + "/v1/probe?timeout=1", headers=PROBE) as resp:
                assert resp.status == 503 and not (await resp.json())["ok"]
        start = time.monotonic()
        assert server.stop() == 0
        stopped_in = time.monotonic() - start
        log = server.log()
    assert log.count("Traceback") == 1 and f"RuntimeError: {FAULT_TEXT}" in log, log
    print(f"error fault: {len(streams)} streams and {len(answers)} whole answers all failed "
          f"explicitly; stopped in {stopped_in:.2f}s")

    # A restarted process serves (the fault is again FAULT_STEPS steps away).
    with serve(*ERROR_FLAGS, check_log=False) as server:
        async with aiohttp.ClientSession() as session:
            status, body, _ = await whole(session, server.url, "/v1/completions", {
                "model": "fake", "prompt": "are you back?", "max_tokens": 5})
            assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
            async with session.get(server.url + "/ready") as resp:
                assert resp.status == 200


@pytest.mark.serial  # the probe answers within 1.5 s of a 1 s deadline
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("frozen_gc")
async def test_model_hang_probe_fails_within_deadline_and_stop_still_works() -> None:
    shutdown_s = 2.0
    with serve(*FAKE, "--fake-decode-step-ms", "10", "--fake-fault", "hang",
               "--fake-fault-after-steps", "5", shutdown_timeout=shutdown_s,
               env=PROBE_ENV) as server:
        url = server.url
        async with aiohttp.ClientSession() as session:
            stuck = asyncio.create_task(stream_request(
                session, url, {"model": "fake", "prompt": "this will hang", "max_tokens": 100,
                               "ignore_eos": True}, timeout=60))
            await wait_state(session, url, lambda st: st["steps"] >= 5 and st["running"] == 1)
            await asyncio.sleep(0.2)  # the 6th step is now stuck in the model
            start = time.monotonic()
            async with session.post(url + "/v1/probe?timeout=1", headers=PROBE) as resp:
                probe_s = time.monotonic() - start
                body = await resp.json()
                assert resp.status == 503 and body["ok"] is False, body
            assert probe_s < 1.5, f"the probe took {probe_s:.2f}s for a 1 s deadline"
            # The event loop is not blocked by the stuck model: liveness still answers.
            start = time.monotonic()
            async with session.get(url + "/health") as resp:
                assert resp.status in (200, 503)
            assert time.monotonic() - start < 0.5
            assert not stuck.done()
            # SIGTERM: drain for shutdown_timeout, then abandon the stuck step and exit.
            start = time.monotonic()
            assert server.stop() == 0
            stopped_in = time.monotonic() - start
            out = await asyncio.wait_for(stuck, 5)
    assert stopped_in < shutdown_s + STOP_GRACE_SECONDS + 3, stopped_in
    assert out.status == 200 and out.error and "shut down" in out.error and not out.done, out
    print(f"hang fault: probe failed in {probe_s * 1000:.0f} ms (deadline 1 s); SIGTERM stopped "
          f"the process in {stopped_in:.1f}s, the stuck stream got an error event")
