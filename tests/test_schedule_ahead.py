"""Steps scheduled ahead: in steady decoding the engine queues the step after the one running
before that one's tokens are known, its rows' inputs filled in on the model thread from the
step before. What it must not change: tokens, finish reasons, KV accounting; when it must not
apply: anything but plain decodes with nothing waiting."""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import (
    PENDING_TOKEN,
    RunnerOutput,
    SchedulerOutput,
    fill_pending_inputs,
)
from batcher.core.request import Request, RequestStatus
from batcher.core.sampling import SamplingParams
from batcher.core.scheduler import Scheduler
from batcher.engine.engine import AsyncEngine
from batcher.engine.fake_runner import FakeRunner, FakeSpeed, QueuedFakeRunner
from batcher.runtime.model_runner import ModelRunner
from batcher.tokenizer.tokenizer import load_tokenizer

BS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def plain(max_tokens: int = 50, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(31 * j + salt) % 4000 + 10 for j in range(n)]


def sampled(out: SchedulerOutput, token: int = 7) -> RunnerOutput:
    ids = [s.request_id for s in out.seqs if s.sample]
    return RunnerOutput(ids, [token] * len(ids), [])


def decoding(*sampling: SamplingParams, num_blocks: int = 64, speculative: str = "none",
             prompt_len: int = 20) -> Scheduler:
    """A scheduler whose requests have read their prompts and decode."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, speculative=speculative)
    sched = Scheduler(cfg, KVCacheManager(num_blocks, BS), debug_checks=True)
    for i, sp in enumerate(sampling):
        sched.add_request(Request(f"r{i}", prompt(prompt_len, i), sp))
    out = sched.schedule()
    sched.update(out, sampled(out))
    assert all(len(r.token_ids) - r.num_computed_tokens == 1 for r in sched.running)
    return sched


def test_the_step_ahead_is_each_row_one_position_on_with_its_input_pending() -> None:
    sched = decoding(plain(), plain())
    prev = sched.schedule()
    steps = sched.stats.steps
    ahead = sched.schedule_ahead(prev)
    assert ahead is not None and ahead.inputs_pending and sched.stats.steps == steps + 1
    assert [s.request_id for s in ahead.seqs] == [s.request_id for s in prev.seqs]
    for a, p in zip(ahead.seqs, prev.seqs, strict=True):
        assert a.token_ids == [PENDING_TOKEN] and a.start_pos == p.start_pos + 1
        assert a.sample and a.output_index == p.output_index + 1
        assert a.block_ids is sched.get_request(a.request_id).block_ids
    # Applied in order, as the engine does: the tokens land where plain decoding puts them.
    sched.update(prev, RunnerOutput(["r0", "r1"], [101, 201], []))
    fill_pending_inputs(ahead, RunnerOutput(["r0", "r1"], [101, 201], []))
    assert [s.token_ids for s in ahead.seqs] == [[101], [201]] and not ahead.inputs_pending
    sched.update(ahead, RunnerOutput(["r0", "r1"], [102, 202], []))
    for rid, toks in (("r0", [101, 102]), ("r1", [201, 202])):
        req = sched.get_request(rid)
        assert req.token_ids[-2:] == toks and req.num_computed_tokens == len(req.token_ids) - 1


def test_a_request_the_step_before_ends_by_length_gets_no_row() -> None:
    sched = decoding(plain(max_tokens=2), plain())  # r0 has one token; prev samples its last
    ahead = sched.schedule_ahead(sched.schedule())
    assert ahead is not None and [s.request_id for s in ahead.seqs] == ["r1"]


def test_a_row_at_a_block_boundary_gets_its_block_and_none_left_means_no_step() -> None:
    sched = decoding(plain(), prompt_len=BS - 1)  # prev computes position 15, the block's last
    req = sched.get_request("r0")
    assert len(req.block_ids) == 1
    ahead = sched.schedule_ahead(sched.schedule())
    assert ahead is not None and ahead.seqs[0].start_pos == BS and len(req.block_ids) == 2
    assert ahead.seqs[0].block_ids is req.block_ids
    sched.check_integrity()

    # Two requests hold the pool's two blocks: the next position has none to take.
    full = decoding(plain(10), plain(10), num_blocks=2, prompt_len=BS - 1)
    assert full.schedule_ahead(full.schedule()) is None
    full.check_integrity()


@pytest.mark.parametrize("case", ["waiting", "prefill", "penalty", "grammar",
                                  "min_tokens", "speculative"])
def test_anything_but_steady_plain_decoding_is_left_to_schedule(case: str) -> None:
    sp = {"penalty": plain(presence_penalty=0.5), "grammar": plain(grammar="g"),
          "min_tokens": plain(min_tokens=5)}.get(case, plain())
    sched = decoding(plain(), sp, speculative="ngram" if case == "speculative" else "none")
    if case == "prefill":
        sched.add_request(Request("late", prompt(40, 9), plain()))
    prev = sched.schedule()
    if case == "waiting":
        sched.add_request(Request("late", prompt(40, 9), plain()))
    assert sched.schedule_ahead(prev) is None


def test_an_abort_is_freed_by_the_step_ahead_and_told_with_it() -> None:
    sched = decoding(plain(), plain())
    prev = sched.schedule()
    sched.abort("r0")  # while prev runs
    ahead = sched.schedule_ahead(prev)
    assert ahead is not None and [s.request_id for s in ahead.seqs] == ["r1"]
    assert ahead.freed_ids == ["r0"] and sched.get_request("r0") is None
    assert [u.request_id for u in sched.update(prev, sampled(prev))] == ["r1"]
    sched.check_integrity()


def test_a_running_request_without_a_row_before_stops_the_chain() -> None:
    """A prompt paced to nothing this step, or a batch over the token budget, leaves a running
    request out of a step: continuing only the others would starve it."""
    sched = decoding(plain(), plain(), plain())
    prev = sched.schedule()
    prev.seqs = prev.seqs[:-1]  # as if "r2" got no row
    assert sched.schedule_ahead(prev) is None


def test_an_abort_of_every_row_yields_an_empty_step_that_reports_it() -> None:
    sched = decoding(plain())
    prev = sched.schedule()
    sched.abort("r0")
    ahead = sched.schedule_ahead(prev)
    assert ahead is not None and ahead.is_empty and ahead.freed_ids == ["r0"]
    assert not sched.has_unfinished()


def test_aborts_freed_when_no_row_gets_a_block_are_still_reported() -> None:
    """The abort frees one block; the next row takes it and the last finds none: no rows, and
    an empty step reports the abort (left in the scheduler, it would wait for a next request)."""
    sched = decoding(plain(10), plain(10), plain(10), num_blocks=3, prompt_len=BS - 1)
    prev = sched.schedule()
    sched.abort("r0")
    ahead = sched.schedule_ahead(prev)
    assert ahead is not None and ahead.is_empty and ahead.freed_ids == ["r0"]
    assert sched.get_request("r0") is None
    sched.update(prev, sampled(prev))
    sched.check_integrity()


def test_a_step_refused_ahead_leaves_pending_aborts_to_schedule() -> None:
    sched = decoding(plain(), plain(min_tokens=5))
    prev = sched.schedule()
    sched.abort("r0")
    assert sched.schedule_ahead(prev) is None
    assert sched.get_request("r0") is not None  # freed by the next schedule(), and told there
    sched.update(prev, sampled(prev))
    assert sched.schedule().freed_ids == ["r0"]


def test_a_request_ended_since_its_row_was_scheduled_gets_none_ahead() -> None:
    sched = decoding(plain(), plain())
    prev = sched.schedule()
    sched.finish("r0", RequestStatus.FINISHED_STOPPED)  # a stop string, while prev runs
    ahead = sched.schedule_ahead(prev)
    assert ahead is not None and [s.request_id for s in ahead.seqs] == ["r1"]
    updates = sched.update(prev, sampled(prev))
    assert [u.request_id for u in updates] == ["r1"]  # r0's wasted row is dropped


def test_a_row_without_its_token_before_is_refused_not_run() -> None:
    sched = decoding(plain(), plain())
    ahead = sched.schedule_ahead(sched.schedule())
    with pytest.raises(RuntimeError, match="r1"):
        fill_pending_inputs(ahead, RunnerOutput(["r0"], [5], []))


class Recording:
    """A runner that records every row it ran and refuses a placeholder input."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_blocks, self.block_size = inner.num_blocks, inner.block_size
        self.ahead_steps = 0
        self.rows: list[tuple[str, int, int]] = []  # (request, position, input token)
        self.fail_at: int | None = None

    def attach_tokenizer(self, tok) -> None:
        if hasattr(self.inner, "attach_tokenizer"):
            self.inner.attach_tokenizer(tok)

    def execute(self, sched):
        self.record(sched)
        return self.inner.execute(sched)

    def record(self, sched) -> None:
        """Note the step's rows as they run (no placeholder left) and inject the fault."""
        for s in sched.seqs:
            assert PENDING_TOKEN not in s.token_ids, s.request_id
            self.rows.append((s.request_id, s.start_pos, s.token_ids[0]))
        if self.fail_at is not None and len(self.rows) >= self.fail_at:
            raise RuntimeError("injected model fault")


class RecordingQueued(Recording):
    """The same over a runner that launches a step and reads it back apart (the engine then
    launches on its model thread and reads on its reader thread): rows recorded at launch,
    once the runner has put in a step ahead's inputs."""

    def launch(self, sched, before=None):
        launched = self.inner.launch(sched, before)
        self.record(sched)
        return launched

    def finish(self, launched):
        return self.inner.finish(launched)


def counting_ahead(engine: AsyncEngine) -> list[int]:
    """How many steps the scheduler scheduled ahead (a one-item list, updated in place)."""
    count = [0]
    schedule_ahead = engine.scheduler.schedule_ahead

    def counted(prev):
        out = schedule_ahead(prev)
        count[0] += out is not None
        return out

    engine.scheduler.schedule_ahead = counted
    return count


async def run_mix(engine: AsyncEngine, stop_token: int | None) -> dict[str, tuple]:
    """Requests of several lengths, one arriving mid-stream, one aborted, one ended by a stop
    token: each one's tokens and finish reason."""
    got: dict[str, tuple] = {}

    async def one(rid: str, ids: list[int], sp: SamplingParams, delay: float = 0.0,
                  leave_after: int | None = None) -> None:
        await asyncio.sleep(delay)
        toks, reason = [], None
        async for ev in engine.generate(Request(rid, ids, sp)):
            toks += ev.token_ids
            reason = ev.finish_reason
            if leave_after is not None and len(toks) >= leave_after:
                reason = "left"
                break
        got[rid] = (toks, reason)

    stop = {"stop_token_ids": [stop_token]} if stop_token is not None else {}
    await asyncio.gather(
        one("a", prompt(12, 1), plain(40)), one("b", prompt(30, 2), plain(9)),
        one("c", prompt(5, 3), plain(60, **stop)), one("d", prompt(17, 4), plain(25), 0.02),
        one("e", prompt(8, 5), plain(50), leave_after=6))
    return got


def fake_engine(tokenizer, ahead: bool, queued: bool = False) -> tuple[AsyncEngine, Recording]:
    """`queued`: the fake device queues steps as a GPU's stream does (launched on the model
    thread, read back on the reader thread)."""
    kind, wrap = (QueuedFakeRunner, RecordingQueued) if queued else (FakeRunner, Recording)
    runner = wrap(kind(64, BS, tokenizer.vocab_size,
                       FakeSpeed(decode_step_s=0.001, per_seq_s=0.0)))
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                            max_num_batched_tokens=64),
                         debug_checks=True)
    engine.ahead = ahead
    return engine, runner


@pytest.mark.parametrize("queued", [False, True])
async def test_tokens_and_reasons_are_the_same_with_steps_ahead_and_without(tokenizer,
                                                                           queued) -> None:
    results, counts = {}, {}
    stop_token = None
    for ahead in (False, True):
        engine, runner = fake_engine(tokenizer, ahead, queued)
        count = counting_ahead(engine)
        await engine.start()
        try:
            if stop_token is None:  # "c"'s 20th token, as plain decoding samples it
                toks, _ = (await run_mix(engine, None))["c"]
                stop_token = toks[19]
                engine.scheduler.check_integrity()
            results[ahead] = await run_mix(engine, stop_token)
            await asyncio.sleep(0.05)  # a queued step of a request that ended finishes
            snap = engine.snapshot()
            assert snap.free_blocks == snap.total_blocks
            engine.scheduler.check_integrity()
        finally:
            await engine.stop()
        counts[ahead] = count[0]
    assert results[True] == results[False]
    assert results[True]["c"][1] == "stop" and len(results[True]["c"][0]) == 20
    assert results[True]["b"][1] == "length" and results[True]["e"][1] == "left"
    assert counts[False] == 0 and counts[True] > 20  # most steps were scheduled ahead


@pytest.mark.parametrize("model", ["tiny_fp32", "smollm_fp32"])
async def test_the_real_runner_decodes_the_same_greedy_tokens_ahead(model, request,
                                                                    tokenizer) -> None:
    """The model runner itself, on the tiny model and on the bundled one (fp32), with the
    time limit lifted (steps on this CPU are longer than it)."""
    loaded = request.getfixturevalue(model)
    outs = {}
    for ahead in (False, True):
        runner = Recording(ModelRunner(loaded, num_blocks=64, block_size=BS))
        engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                                max_num_batched_tokens=64),
                             debug_checks=True)
        engine.ahead, engine.ahead_max_step_s = ahead, float("inf")  # whatever this CPU takes
        count = counting_ahead(engine)
        await engine.start()
        try:
            async def one(rid: str, ids: list[int], n: int) -> list[int]:
                return [t async for ev in engine.generate(Request(rid, ids, plain(n)))
                        for t in ev.token_ids]

            outs[ahead] = await asyncio.gather(one("x", prompt(9, 1), 24),
                                               one("y", prompt(21, 2), 31),
                                               one("z", prompt(14, 3), 7))
        finally:
            await engine.stop()
        assert (count[0] > 10) is ahead
    assert outs[True] == outs[False]


@pytest.mark.parametrize("queued", [False, True])
async def test_a_failed_step_fails_everyone_and_its_queued_step_never_runs_a_placeholder(
        tokenizer, queued) -> None:
    engine, runner = fake_engine(tokenizer, True, queued)
    count = counting_ahead(engine)
    runner.fail_at = 30  # rows: past the prompts, while decoding two streams
    await engine.start()
    try:
        async def one(rid: str) -> str | None:
            last = None
            async for ev in engine.generate(Request(rid, prompt(6, len(rid)), plain(100))):
                last = ev
            return last.finish_reason

        reasons = await asyncio.gather(one("p"), one("qq"))
        await asyncio.sleep(0.05)  # the queued step, if any, ends on the model thread
    finally:
        await engine.stop()
    assert reasons == ["error", "error"] and count[0] > 0
    assert not engine.healthy


@pytest.mark.parametrize("queued", [False, True])
async def test_an_aborted_stream_ends_while_steps_run_ahead(tokenizer, queued) -> None:
    """Its row in the queued step is wasted; the step after frees it and its stream ends."""
    engine, runner = fake_engine(tokenizer, True, queued)
    count = counting_ahead(engine)
    await engine.start()
    try:
        got = 0
        async with asyncio.timeout(5.0):
            async for ev in engine.generate(Request("x", prompt(6), plain(1000))):
                got += len(ev.token_ids)
                if got >= 30:
                    assert engine.abort("x")
                    break
            while engine.owns("x") or engine.scheduler.has_unfinished():
                await asyncio.sleep(0.002)
        assert count[0] > 0
        snap = engine.snapshot()
        assert snap.free_blocks == snap.total_blocks
    finally:
        await engine.stop()


async def test_slow_steps_are_not_scheduled_ahead(tokenizer) -> None:
    """Steps longer than `ahead_max_step_s` (a CPU's) run as before: a request arriving
    meanwhile does not wait for a queued step."""
    engine, runner = fake_engine(tokenizer, True)
    engine.ahead_max_step_s = 0.0005  # below the fake model's 1 ms steps
    count = counting_ahead(engine)
    await engine.start()
    try:
        got = [t async for ev in engine.generate(Request("x", prompt(6), plain(20)))
               for t in ev.token_ids]
    finally:
        await engine.stop()
    assert len(got) == 20 and count[0] == 0
