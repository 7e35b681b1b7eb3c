"""AsyncEngine with the real tiny model: continuous batching, preemption, abort, faults."""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.config import SchedulerConfig
from batcher.engine.engine import AsyncEngine
from batcher.engine.events import EngineError
from batcher.core.request import Request
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from batcher.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def make_engine(loaded, tokenizer, num_blocks=256, **sched) -> AsyncEngine:
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=16)
    cfg = SchedulerConfig(**({"max_num_seqs": 64, "max_num_batched_tokens": 256} | sched))
    return AsyncEngine(runner, tokenizer, cfg, debug_checks=True)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def run_all(engine: AsyncEngine, prompts: list[list[int]], sp: SamplingParams,
                  delays: list[float] | None = None) -> list[list[int]]:
    async def one(i: int, ids: list[int]) -> list[int]:
        if delays:
            await asyncio.sleep(delays[i])
        out: list[int] = []
        async for ev in engine.generate(Request(f"r{i}", ids, sp)):
            out += ev.token_ids
            if ev.finished:
                assert ev.finish_reason == "length", ev
        return out

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def prompts_of(n: int, base: int = 20) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 5000 + 100 for j in range(base + 9 * i)] for i in range(n)]


async def test_preemption_gives_same_greedy_tokens(tiny_fp32, tokenizer):
    prompts = prompts_of(8)
    big = make_engine(tiny_fp32, tokenizer, num_blocks=256)
    await big.start()
    want = await run_all(big, prompts, greedy(40))
    await big.stop()
    # 14 blocks of 16 cannot hold 8 sequences of up to ~125 tokens: preemption must happen.
    small = make_engine(tiny_fp32, tokenizer, num_blocks=14)
    await small.start()
    got = await run_all(small, prompts, greedy(40))
    assert small.scheduler.stats.preemptions > 0
    assert got == want
    assert small.kv.num_free_blocks == small.kv.num_total_blocks
    await small.stop()


async def test_64_concurrent_requests_complete(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer, num_blocks=512)
    await engine.start()
    prompts = prompts_of(64, base=5)
    lengths = [5 + (i % 7) * 3 for i in range(64)]

    async def one(i: int) -> int:
        n = 0
        async for ev in engine.generate(Request(f"c{i}", prompts[i], greedy(lengths[i]))):
            n += len(ev.token_ids)
        return n

    got = await asyncio.gather(*(one(i) for i in range(64)))
    assert got == lengths
    st = engine.snapshot()
    assert st.free_blocks == st.total_blocks and st.running == st.waiting == 0
    await engine.stop()


async def test_staggered_arrivals_equal_batch_alone(tiny_fp32, tokenizer):
    prompts = prompts_of(6)
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    alone = [(await run_all(engine, [p], greedy(24)))[0] for p in prompts]
    staggered = await run_all(engine, prompts, greedy(24), delays=[0.0, 0.01, 0.03, 0.05,
                                                                  0.08, 0.1])
    assert staggered == alone
    await engine.stop()


async def test_abort_frees_blocks_at_next_step(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    req = Request("long", prompts_of(1)[0], greedy(500))
    seen = 0
    events = engine.generate(req)
    async for ev in events:
        seen += len(ev.token_ids)
        if seen >= 3:
            break
    await events.aclose()  # leaving early aborts
    for _ in range(100):
        if engine.snapshot().running == 0:
            break
        await asyncio.sleep(0.01)
    st = engine.snapshot()
    assert st.running == 0 and st.free_blocks == st.total_blocks
    await engine.stop()


async def test_abort_by_id_ends_stream_with_abort(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    final = None
    async for ev in engine.generate(Request("x", prompts_of(1)[0], greedy(500))):
        if ev.token_ids and final is None:
            assert engine.abort("x")
        if ev.finished:
            final = ev
    assert final is not None and final.finish_reason == "abort"
    assert final.num_output_tokens < 500
    await engine.stop()


async def test_stop_string_ends_text_before_it(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    prompt = prompts_of(1)[0]
    full = ""
    async for ev in engine.generate(Request("a", prompt, greedy(30))):
        full += ev.text
    stop = full[10:14]
    assert stop and stop.strip()
    text, final = "", None
    async for ev in engine.generate(Request("b", prompt, greedy(30, stop=[stop]))):
        text += ev.text
        final = ev
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert text == full[: full.index(stop)]
    assert engine.snapshot().free_blocks == engine.snapshot().total_blocks
    await engine.stop()


async def test_model_fault_fails_every_request(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    calls = 0
    real = engine.runner.launch  # what the engine calls on the model thread

    def flaky(sched, before=None):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault")
        return real(sched, before)

    engine.runner.launch = flaky
    await engine.start()

    async def one(i):
        async for ev in engine.generate(Request(f"f{i}", prompts_of(1)[0], greedy(50))):
            if ev.finished:
                return ev

    finals = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 10)
    assert all(f.finish_reason == "error" and "injected fault" in f.error for f in finals)
    st = engine.snapshot()
    assert not st.healthy and "injected fault" in st.error
    with pytest.raises(EngineError):
        async for _ in engine.generate(Request("late", [1, 2, 3], greedy(2))):
            pass
    await engine.stop()


async def test_probe_runs_ahead_of_queue(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    latency = await engine.probe(timeout=10)
    assert latency > 0
    await engine.stop()


async def test_min_tokens_suppresses_stop_tokens(tiny_fp32, tokenizer):
    engine = make_engine(tiny_fp32, tokenizer)
    await engine.start()
    prompt = prompts_of(1)[0]
    first: list[int] = []
    async for ev in engine.generate(Request("a", prompt, greedy(5))):
        first += ev.token_ids
    # Make the greedy third token a stop token: below min_tokens it must not be chosen.
    sp = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first[2]], min_tokens=4)
    got: list[int] = []
    async for ev in engine.generate(Request("b", prompt, sp)):
        got += ev.token_ids
    assert got[:2] == first[:2] and got[2] != first[2]
    await engine.stop()


async def test_generate_starts_the_engine_when_nobody_did(tiny_fp32, tokenizer):
    """A library caller that forgets `start()` gets its answer, not a request waiting forever."""
    engine = make_engine(tiny_fp32, tokenizer)
    try:
        got = await asyncio.wait_for(run_all(engine, prompts_of(1), greedy(4)), timeout=120)
        assert len(got[0]) == 4
    finally:
        await engine.stop()
