"""The engine launches each step before it emits the previous step's tokens: the model runs step
N+1 while the host detokenizes and streams step N. What that may cost (one wasted row for a
request a stop string ends) and what it must not change (tokens, KV accounting)."""

from __future__ import annotations

import asyncio
import time

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.core.spec_verify import run_by_rule
from batcher.engine.engine import AsyncEngine
from batcher.runtime.model_runner import ModelRunner
from batcher.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class CountingRunner:
    """The real runner, counting the steps it started and the rows each request sampled."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size
        self.started = 0
        self.sampled: dict[str, int] = {}

    def attach_tokenizer(self, tok) -> None:
        self.inner.attach_tokenizer(tok)

    def execute(self, sched):
        self.started += 1
        for s in sched.seqs:
            if s.sample:
                self.sampled[s.request_id] = self.sampled.get(s.request_id, 0) + 1
        return self.inner.execute(sched)


def engine_over(loaded, tokenizer, overlap: bool) -> tuple[AsyncEngine, CountingRunner]:
    runner = CountingRunner(ModelRunner(loaded, num_blocks=128, block_size=16))
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
    return AsyncEngine(runner, tokenizer, cfg, debug_checks=True, overlap=overlap), runner


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def idle(engine: AsyncEngine) -> None:
    """Until the engine's loop has no step in flight and nothing to run (a step launched before
    the last tokens were emitted may still be running when its stream ends)."""
    deadline = time.monotonic() + 5.0
    while engine.busy_since is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert engine.busy_since is None


PROMPT = [(13 * j) % 5000 + 100 for j in range(24)]


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_next_step_runs_while_this_one_is_emitted(tiny_fp32, tokenizer, overlap):
    engine, runner = engine_over(tiny_fp32, tokenizer, overlap)
    seen: list[bool] = []  # per emit with work left: had the next step started by then?
    emit = engine.outputs.emit

    def watched(updates, now):
        if engine.scheduler.has_unfinished():
            deadline = time.monotonic() + (5.0 if overlap else 0.0)
            while runner.started <= engine.steps and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(runner.started > engine.steps)
        emit(updates, now)

    engine.outputs.emit = watched
    await engine.start()
    try:
        got = [t async for ev in engine.generate(Request("a", PROMPT, greedy(8)))
               for t in ev.token_ids]
    finally:
        await engine.stop()
    assert len(got) == 8 and len(seen) == 7
    assert seen == [overlap] * 7


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_stop_string_costs_at_most_one_row_and_no_blocks(tiny_fp32, tokenizer, overlap):
    engine, runner = engine_over(tiny_fp32, tokenizer, overlap)
    await engine.start()
    try:
        full = "".join([ev.text async for ev in engine.generate(
            Request("full", PROMPT, greedy(30)))])
        stop = full[10:14]
        assert stop.strip()
        text, final = "", None
        async for ev in engine.generate(Request("cut", PROMPT, greedy(30, stop=[stop]))):
            text, final = text + ev.text, ev
        assert final.finish_reason == "stop" and text == full[: full.index(stop)]
        assert final.num_output_tokens < 30
        await idle(engine)
        # With overlap the step after the one whose text matched was already running: its row
        # for the request is computed and its token dropped.
        assert runner.sampled["cut"] == final.num_output_tokens + (1 if overlap else 0)
        # Its blocks were freed while that step ran, and none is lost or held twice.
        snap = engine.snapshot()
        assert snap.free_blocks == snap.total_blocks
        engine.scheduler.check_integrity()
        # The blocks are handed out again, and greedy tokens are unchanged.
        again = [t async for ev in engine.generate(Request("again", PROMPT, greedy(30)))
                 for t in ev.token_ids]
        assert tokenizer.decode(again) == full
    finally:
        await engine.stop()


class ScriptedRunner:
    """Token at position p: WORDS[p % len(WORDS)]; each step takes `step_s` (its GIL
    released, as a device's would be). `cut` names a request whose rows from output index
    `cut[1]` on are cut, as a grammar over its budget is."""

    num_blocks, block_size = 64, 16

    def __init__(self, words: list[int], step_s: float = 0.02) -> None:
        self.words, self.step_s = words, step_s
        self.cut: tuple[str, int] | None = None

    def execute(self, sched):
        time.sleep(self.step_s)
        out = run_by_rule(sched.seqs, lambda _t, p: self.words[p % len(self.words)])
        for s in sched.seqs:
            if self.cut and s.sample and (s.request_id, True) == (
                    self.cut[0], s.output_index >= self.cut[1]):
                out.failed[s.request_id] = "grammar_too_costly: cut on this row"
        return out


@pytest.mark.parametrize("cut", [False, True])
async def test_an_id_is_free_again_once_its_final_event_is_out(tokenizer, cut):
    """A client may send its next request under the same ID as soon as the last one ended, while
    the step launched before that end still holds the old request's row: what that step reports
    for the ID (its freeing, a grammar cut) belongs to the old request, not the new one."""
    words = tokenizer.encode(" alpha beta gamma STOP delta epsilon zeta eta theta iota")
    runner = ScriptedRunner(words)
    engine = AsyncEngine(runner, tokenizer,
                         SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
                         debug_checks=True)
    await engine.start()

    async def run(rid: str, prompt: list[int], n: int, stop=None):
        final = None
        async for ev in engine.generate(Request(rid, prompt, greedy(n)), stop=stop):
            final = ev
        return final

    try:
        # Another stream keeps a slot busy, so the reused ID waits in the queue a while.
        busy = asyncio.ensure_future(run("busy", [words[0]] * 4, 40))
        first = await run("abc", words[:1], 30, stop=["STOP"])
        assert first.finish_reason == "stop"
        if cut:  # the old request's next row, which only the step in flight runs
            runner.cut = ("abc", first.num_output_tokens)
        assert not engine.owns("abc")
        other = asyncio.ensure_future(run("other", [words[2]] * 4, 20))
        await asyncio.sleep(0)
        again = await run("abc", [words[1]] * 3, 3)
        await busy
        await other
    finally:
        await engine.stop()
    assert again.finish_reason == "length" and again.error is None
    assert again.num_output_tokens == 3
    assert again.times.preemptions == 0 and again.times.requeue_before_first_token == 0


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_pause_while_emitting_is_noted_as_a_stall(tokenizer, overlap):
    engine = AsyncEngine(ScriptedRunner([300, 301, 302], step_s=0.01), tokenizer,
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                         overlap=overlap)
    emit, emitted = engine.outputs.emit, [0]

    def paused(updates, now):
        emitted[0] += 1
        if emitted[0] == 5:
            time.sleep(0.3)  # a GC pause, a blocked handler
        emit(updates, now)

    engine.outputs.emit = paused
    await engine.start()
    try:
        async for _ in engine.generate(Request("a", [400] * 8, greedy(12))):
            pass
    finally:
        await engine.stop()
    spans = [b - a for a, b in engine.stall_log.spans]
    assert len(spans) == 1 and 0.25 < spans[0] < 0.5, spans


async def test_the_real_runner_says_when_its_step_is_under_way(tiny_fp32, tokenizer):
    """The engine holds its emitting back until the model thread's step is under way: the real
    runner says so once a step (as it starts on a CPU; once queued on a GPU)."""
    engine, runner = engine_over(tiny_fp32, tokenizer, True)
    model_runner = runner.inner
    assert not engine.model_steps.runner_signals  # the counting wrapper has no hook: set as steps start
    engine = AsyncEngine(model_runner, tokenizer,
                         SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256))
    assert (engine.model_steps.runner_signals
            and model_runner.on_launch == engine.model_steps.under_way)
    calls = []
    signal = model_runner.on_launch
    model_runner.on_launch = lambda: (calls.append(1), signal())
    await engine.start()
    try:
        got = [t async for ev in engine.generate(Request("a", PROMPT, greedy(5)))
               for t in ev.token_ids]
        await idle(engine)
    finally:
        await engine.stop()
    assert len(got) == 5 and len(calls) == engine.steps


async def test_a_failure_on_the_hosts_side_ends_every_stream_with_an_error(tokenizer):
    engine = AsyncEngine(ScriptedRunner([300, 301, 302], step_s=0.001), tokenizer,
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    update, calls = engine.scheduler.update, [0]

    def failing(sched, out):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected host fault")
        return update(sched, out)

    engine.scheduler.update = failing
    await engine.start()

    async def final(rid: str):
        last = None
        async for ev in engine.generate(Request(rid, [400] * 8, greedy(50))):
            last = ev
        return last

    try:
        finals = await asyncio.wait_for(asyncio.gather(final("a"), final("b")), 10)
    finally:
        await engine.stop()
    assert all(f.finish_reason == "error" and "injected host fault" in f.error for f in finals)
    assert not engine.healthy
