"""How the engine hands tokens to its streams' readers: merged when a reader is behind, its wakes
paced when tokens come faster than the loop should switch tasks, and never a token lost."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.outputs import TokenLogprobs
from batcher.engine.engine import AsyncEngine
from batcher.engine.events import EngineEvent
from batcher.engine.fake_runner import FakeRunner, FakeSpeed
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.telemetry.timings import EngineTimes
from batcher.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_absorb_reads_as_one_event_and_takes_every_final_field() -> None:
    first = EngineEvent("r", "ab", [1, 2], [None, TokenLogprobs(-0.5, ())],
                        prompt_logprobs=[TokenLogprobs(-1.0, ())])
    final = EngineEvent("r", "c", [3], [None], finish_reason="stop", error=None,
                        stop_reason="x", num_prompt_tokens=4, num_output_tokens=3,
                        num_cached_tokens=1, queue_wait=0.1, ttft=0.2, e2e=0.3,
                        token_times=[1.0, 1.0, 2.0], priority=5,
                        times=EngineTimes(first_scheduled=0.0, first_token=1.0))
    first.absorb(final)
    assert (first.text, first.token_ids) == ("abc", [1, 2, 3])
    assert len(first.logprobs) == 3 and first.prompt_logprobs is not None
    # Every field a final event carries, whatever is added to it later.
    for f in dataclasses.fields(EngineEvent):
        if f.name not in ("request_id", "text", "token_ids", "logprobs", "prompt_logprobs"):
            assert getattr(first, f.name) == getattr(final, f.name), f.name


async def test_a_reader_behind_gets_every_token_once_in_fewer_events(tokenizer) -> None:
    runner = FakeRunner(1024, 16, tokenizer.vocab_size, FakeSpeed(float("inf"), 0.0, 0.0))
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=64,
                                                            max_num_batched_tokens=2048))
    await engine.start()

    async def one(i: int, slow: bool) -> tuple[list[int], str, int, EngineEvent]:
        sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        ids: list[int] = []
        text, events, last = "", 0, None
        async for ev in engine.generate(Request(f"r{i}", [100 + i, 200, 300], sp)):
            ids += ev.token_ids
            text += ev.text
            events += 1
            last = ev
            if slow:
                await asyncio.sleep(0.002)  # a reader that falls behind the steps
        assert last is not None and last.finished
        return ids, text, events, last

    results = await asyncio.gather(*(one(i, slow=i % 2 == 0) for i in range(32)))
    await engine.stop()
    for ids, text, events, last in results:
        assert len(ids) == 200 == last.num_output_tokens and len(last.token_times) == 200
        assert text == tokenizer.decode(ids)
        assert events < 200  # merged: 32 streams of a model that costs nothing
    slow_events = [r[2] for i, r in enumerate(results) if i % 2 == 0]
    assert max(slow_events) < 150


async def test_a_lone_stream_is_never_held(tokenizer) -> None:
    runner = FakeRunner(256, 16, tokenizer.vocab_size, FakeSpeed(float("inf"), 0.001, 0.0))
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                            max_num_batched_tokens=256))
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    events = [ev async for ev in engine.generate(Request("solo", [5, 6, 7], sp))]
    await engine.stop()
    assert [len(ev.token_ids) for ev in events] == [1] * 20  # a reader keeping up: one per step
