"""The warm start on real engines: warm-up steps teach nothing, calibration steps teach the
step-time model and admission, a warm server compiles nothing while it serves, and a fast device
(the fake model at `--fake-decode-step-ms 3 --fake-prefill-rate 50000`) admits the whole chat64
burst at default flags; refusals name their reason in the body, a header and the access line."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer
from batcher.engine.warmup import warm_start
from tests.server_process import serve
from tests.test_warm_start import CHAT64


def _engine(lm, **kw) -> AsyncEngine:
    from batcher.core.config import CacheConfig

    return AsyncEngine.from_loaded(lm, load_tokenizer(), SchedulerConfig(16, 128, 1024),
                                   CacheConfig(num_blocks=256), **kw)


async def test_warm_up_teaches_nothing_and_calibration_teaches_the_model(tiny_fp32) -> None:
    engine = _engine(tiny_fp32)
    heard: list[int] = []
    engine.step_listeners.append(lambda sched, s: heard.append(len(sched.seqs)))
    try:
        got = await warm_start(engine, calibrate=False)
        assert got.warmup_steps >= 5 and got.requests > 10  # a light warm-up on the CPU
        assert engine.step_time_model.num_observations == 0 and not heard
        assert engine.phase == "serve"
        got = await warm_start(engine)
        assert got.calibrate_steps > 10
        # Every calibration step but a stalled one (a busy machine may stall a few).
        assert len(heard) >= 0.8 * got.calibrate_steps
        assert engine.step_time_model.num_observations >= len(heard)
        assert got.decode_ms and got.prefill_ms
        # Nothing of the warm start is left holding KV or a slot.
        assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    finally:
        await engine.stop()


async def test_a_spent_budget_leaves_the_rest_out(tiny_fp32) -> None:
    engine = _engine(tiny_fp32)
    try:
        got = await warm_start(engine, warm_budget_s=0.0, calibrate_budget_s=0.0)
        assert got.waves_skipped > 0 and got.warmup_steps == 0 and got.calibrate_steps == 0
        assert engine.phase == "serve"
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_a_warm_server_compiles_nothing_while_it_serves() -> None:
    """`--compile-decode` on the CPU compiles torch graphs: after the warm start, requests of
    every batch size and sampling path compile none (the count covers Triton kernels on CUDA)."""
    from batcher.models.loader import load_model
    from batcher.runtime.compile_count import compilations

    lm = load_model("tiny", dtype="float32", device="cpu")
    engine = _engine(lm, compile_decode=True)
    if engine.runner.compiled is None:
        pytest.skip("torch.compile is not usable here (the runner logged why)")
    try:
        await warm_start(engine)
        before = compilations()
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=3,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=12, logprobs=3, presence_penalty=0.3,
                                 ignore_eos=True)]

        async def one(i: int, n: int) -> None:
            req = Request(f"r{i}", list(range(500 + i, 500 + i + n)), params[i % 3])
            async for _ in engine.generate(req):
                pass

        for batch in (1, 3, 16):
            await asyncio.gather(*(one(100 * batch + i, 5 + 37 * i) for i in range(batch)))
        assert compilations() == before
    finally:
        await engine.stop()


async def _chat(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int
                ) -> tuple[int, dict, dict]:
    body = {"model": "fake", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


@pytest.mark.serial  # admission at the default SLO from measured steps
@pytest.mark.slow
async def test_fast_device_admits_the_chat64_burst_at_default_flags() -> None:
    reqs = json.loads(CHAT64.read_text())["requests"]
    with serve("--model", "fake", "--fake-decode-step-ms", "3", "--fake-prefill-rate", "50000",
               num_blocks=None) as server:
        assert "warm start:" in server.log()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for _ in range(2):  # a cold server, then a warm one
                got = await asyncio.gather(*(
                    _chat(s, server.url, r["prompt_text"], r["max_new_tokens"]) for r in reqs))
                refused = [(st, b) for st, _, b in got if st != 200]
                assert not refused, refused[:3]


@pytest.mark.slow
async def test_refusals_name_their_reason() -> None:
    with serve("--model", "fake", "--fake-decode-step-ms", "50", "--max-waiting", "1",
               num_blocks=None) as server:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            got = await asyncio.gather(*(_chat(s, server.url, "hello there", 8)
                                         for _ in range(8)))
        refused = [(h, b) for st, h, b in got if st == 503]
        assert refused, [st for st, _, _ in got]
        for headers, body in refused:
            assert body["error"]["code"] == "queue_full"
            assert headers["X-Reject-Reason"] == "queue_full"
            assert headers["x-should-retry"] == "true" and int(headers["Retry-After"]) >= 1
        await asyncio.sleep(0.2)
        lines = [ln for ln in server.log().splitlines() if "status=503" in ln]
        assert lines and all(re.search(r"\berror_code=queue_full\b", ln) for ln in lines)
