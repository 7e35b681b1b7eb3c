"""Steps launched with their tokens left on the device: the real runner reads a step's tokens
back on the engine's reader thread, and a step scheduled ahead takes its inputs from the step
before it on the device (`batcher.runtime.launched_step`). What it must not change: tokens and
finish reasons. On a CPU the "device" is the host, so the same code runs here."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from batcher.core.config import SchedulerConfig
from batcher.core.outputs import PENDING_TOKEN, ScheduledSeq, SchedulerOutput
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.engine.engine import AsyncEngine
from batcher.engine.fake_runner import FakeSpeed, QueuedFakeRunner
from batcher.engine.model_thread import ModelThread
from batcher.runtime import model_runner as model_runner_module
from batcher.runtime.launched_step import LaunchedStep, fed_tokens
from batcher.runtime.model_runner import ModelRunner
from batcher.runtime.sampler import Sampler
from batcher.tokenizer.tokenizer import load_tokenizer

BS = 16
GREEDY = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(31 * j + salt) % 4000 + 10 for j in range(n)]


def row(rid: str, token: int, pos: int, sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(rid, [token], pos, [0, 1, 2, 3], sample, GREEDY)


def ahead_of(*rids: str) -> SchedulerOutput:
    return SchedulerOutput([row(r, PENDING_TOKEN, 9) for r in rids], inputs_pending=True)


def test_a_step_ahead_takes_each_rows_token_from_the_step_before_on_the_device() -> None:
    before = LaunchedStep.on_device(SchedulerOutput([row("a", 5, 8), row("b", 6, 8),
                                                     row("c", 7, 8)]),
                                    torch.tensor([41, 42, 43]))
    assert fed_tokens(ahead_of("a", "b", "c"), before).tolist() == [41, 42, 43]
    # A request that ended since has no row: the others keep their own tokens.
    assert fed_tokens(ahead_of("a", "c"), before).tolist() == [41, 43]
    with pytest.raises(RuntimeError, match="sampled no token"):
        fed_tokens(ahead_of("a", "z"), before)


def test_rows_that_sample_nothing_before_are_not_counted() -> None:
    # A prompt chunk that does not end its prompt has no logits row: b's token is row 0.
    chunk = ScheduledSeq("p", [1, 2, 3], 0, [4], False, GREEDY)
    before = LaunchedStep.on_device(SchedulerOutput([row("b", 6, 8), chunk]),
                                    torch.tensor([42]))
    assert fed_tokens(ahead_of("b"), before).tolist() == [42]
    assert before.read().request_ids == ["b"] and before.read().token_ids == [42]


def test_the_sampler_chooses_the_same_tokens_on_the_device() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
             SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=20),
             SamplingParams(temperature=0.7, top_p=0.9, seed=5)]
    seqs = [ScheduledSeq(f"r{i}", [1], 4, [0], True, sp, output_index=i)
            for i, sp in enumerate(kinds)]
    tokens, _ = Sampler(seed=1).sample(logits, seqs)
    assert Sampler(seed=1).sample_on_device(logits, seqs).tolist() == tokens
    wants = [ScheduledSeq("l", [1], 4, [0], True, SamplingParams(temperature=0.0, logprobs=2))]
    with pytest.raises(ValueError, match="logprobs"):
        Sampler().sample_on_device(logits[:1], wants)


def test_a_step_the_host_needs_at_once_is_read_back_at_launch(tiny_fp32) -> None:
    runner = ModelRunner(tiny_fp32, num_blocks=16, block_size=BS)
    plain = SchedulerOutput([ScheduledSeq("g", prompt(5), 0, [0], True, GREEDY)])
    step = runner.launch(plain)
    assert step.out is None and step.tokens is not None  # left for the reader
    wants = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1)
    scored = SchedulerOutput([ScheduledSeq("l", prompt(5), 0, [1], True, wants)])
    step_lp = runner.launch(scored)
    assert step_lp.out is not None and step_lp.out.logprobs[0] is not None
    assert runner.finish(step).token_ids == runner.execute(SchedulerOutput(
        [ScheduledSeq("g2", prompt(5), 0, [2], True, GREEDY)])).token_ids


@pytest.mark.parametrize("model", ["tiny_fp32", "smollm_fp32"])
async def test_the_real_runner_feeds_steps_ahead_on_the_device_and_decodes_the_same(
        model, request, tokenizer, monkeypatch) -> None:
    """The engine over the bare runner (its launch and reader threads), the time limit on
    steps ahead lifted (steps on this CPU are longer than it): greedy, seeded, logprobs and
    stop-token requests give the same tokens and reasons as without steps ahead, and most
    steps ahead took their inputs on the device."""
    loaded = request.getfixturevalue(model)
    fed = [0]

    def counted(sched, before):
        fed[0] += 1
        return fed_tokens(sched, before)

    monkeypatch.setattr(model_runner_module, "fed_tokens", counted)
    outs, feeds = {}, {}
    for ahead in (False, True):
        fed[0] = 0
        runner = ModelRunner(loaded, num_blocks=64, block_size=BS)
        engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                                max_num_batched_tokens=64),
                             debug_checks=True)
        engine.ahead, engine.ahead_max_step_s = ahead, float("inf")
        await engine.start()
        try:
            async def one(rid: str, ids: list[int], sp: SamplingParams) -> tuple:
                toks, reason, lps = [], None, []
                async for ev in engine.generate(Request(rid, ids, sp)):
                    toks += ev.token_ids
                    lps += [lp.logprob for lp in ev.logprobs or [] if lp is not None]
                    reason = ev.finish_reason
                return toks, reason, len(lps)

            # Prompts of different lengths: the runner lays decode rows out longest first,
            # not in scheduled order.
            outs[ahead] = await asyncio.gather(
                one("x", prompt(9, 1), SamplingParams(max_tokens=24, temperature=0.0,
                                                      ignore_eos=True)),
                one("y", prompt(21, 2), SamplingParams(max_tokens=31, temperature=0.9,
                                                       seed=11, ignore_eos=True)),
                one("z", prompt(14, 3), SamplingParams(max_tokens=7, temperature=0.0,
                                                       logprobs=1, ignore_eos=True)))
            snap = engine.snapshot()
            assert snap.free_blocks == snap.total_blocks
        finally:
            await engine.stop()
        feeds[ahead] = fed[0]
    assert outs[True] == outs[False]
    assert outs[True][2][2] == 7  # z's logprobs: its steps were read back at launch
    assert feeds[False] == 0 and feeds[True] > 10


async def test_a_launch_is_finished_on_the_other_thread_in_order() -> None:
    loop = asyncio.get_running_loop()
    launcher, reader = ModelThread("t-launch"), ModelThread("t-read")
    seen: list[tuple[str, int]] = []

    def launch(i: int) -> int:
        seen.append(("launch", i))
        return i

    def finish(i: int) -> int:
        assert threading.current_thread().name == "t-read"
        seen.append(("finish", i))
        if i == 2:
            raise RuntimeError("read failed")
        return 10 * i

    def broken(i: int) -> int:
        raise ValueError("launch failed")

    try:
        futs = [launcher.run(loop, launch, i, then=(reader, finish)) for i in range(2)]
        futs.append(launcher.run(loop, launch, 2, then=(reader, finish)))
        futs.append(launcher.run(loop, broken, 3, then=(reader, finish)))
        got = await asyncio.gather(*futs, return_exceptions=True)
        assert got[:2] == [0, 10]
        assert isinstance(got[2], RuntimeError) and isinstance(got[3], ValueError)
        assert [s for s in seen if s[0] == "finish"] == [("finish", 0), ("finish", 1),
                                                        ("finish", 2)]
        reader.shutdown()
        closed = await asyncio.gather(launcher.run(loop, launch, 4, then=(reader, finish)),
                                      return_exceptions=True)
        assert isinstance(closed[0], RuntimeError)  # the reader is shut down: told, not lost
    finally:
        launcher.shutdown()
        reader.shutdown()


class Counting(QueuedFakeRunner):
    """The queued fake device, counting the steps launched while it still ran the one before."""

    early = 0

    def launch(self, sched, before=None):
        self.early += time.monotonic() < self._busy_until
        return super().launch(sched, before)


async def test_the_model_thread_launches_the_next_step_while_the_device_runs(tokenizer) -> None:
    """On a device that queues steps (as CUDA does), the engine launches a step scheduled ahead
    before the one in front of it has ended, when its tokens are read apart; read on the model
    thread, never. The same tokens either way."""
    got, early = {}, {}
    for apart in (True, False):
        runner = Counting(256, BS, tokenizer.vocab_size,
                          FakeSpeed(prefill_tokens_per_s=float("inf"), decode_step_s=0.004,
                                    per_seq_s=0.0))
        engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                                max_num_batched_tokens=256),
                             debug_checks=True)
        engine.model_steps.read_apart = apart
        await engine.start()
        try:
            async def one(rid: str, n: int) -> list[int]:
                req = Request(rid, prompt(7 + n, n), SamplingParams(
                    max_tokens=n, temperature=0.0, ignore_eos=True))
                return [t async for ev in engine.generate(req) for t in ev.token_ids]

            got[apart] = await asyncio.gather(*(one(f"q{i}", 30 + 5 * i) for i in range(4)))
        finally:
            await engine.stop()
        early[apart] = runner.early
    assert got[True] == got[False]
    assert early[False] == 0 and early[True] > 20


class FailingRead(QueuedFakeRunner):
    """The queued fake device, whose `fail_at`-th read of a step's tokens fails."""

    def __init__(self, *args, fail_at: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.fail_at, self.reads, self.placeholders = fail_at, 0, 0

    def launch(self, sched, before=None):
        out = super().launch(sched, before)
        self.placeholders += sum(PENDING_TOKEN in s.token_ids for s in sched.seqs)
        return out

    def finish(self, launched):
        self.reads += 1
        if self.reads == self.fail_at:
            raise RuntimeError("injected read fault")
        return super().finish(launched)


async def test_a_failed_read_fails_everyone_while_a_step_ahead_is_queued(tokenizer) -> None:
    runner = FailingRead(256, BS, tokenizer.vocab_size,
                         FakeSpeed(prefill_tokens_per_s=float("inf"), decode_step_s=0.003,
                                   per_seq_s=0.0), fail_at=15)
    engine = AsyncEngine(runner, tokenizer, SchedulerConfig(max_num_seqs=8,
                                                            max_num_batched_tokens=256))
    await engine.start()
    try:
        async def one(rid: str) -> str | None:
            last = None
            async for ev in engine.generate(Request(rid, prompt(6, len(rid)), SamplingParams(
                    max_tokens=100, temperature=0.0, ignore_eos=True))):
                last = ev
            return last.finish_reason, last.error

        got = await asyncio.wait_for(asyncio.gather(one("p"), one("qq"), one("rrr")), 10)
    finally:
        await asyncio.wait_for(engine.stop(), 10)
    assert all(reason == "error" and "injected read fault" in error for reason, error in got)
    assert not engine.healthy and runner.placeholders == 0


async def test_the_loop_does_not_wait_for_a_model_thread_still_running_a_step(
        tiny_fp32, tokenizer) -> None:
    """On a CPU the runner's launch is the whole step, and says it is under way as it starts.
    A step queued ahead while the model thread still computes the one before must not hold the
    event loop until that one ends (each wait is capped at `HANDOFF_WAIT_S`; it would hit the
    cap nearly every step)."""
    from batcher.engine.engine import HANDOFF_WAIT_S

    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BS)
    real_launch = runner._launch

    def slow_launch(sched, before):  # a step of at least 10 ms on any host: longer than a wait
        time.sleep(0.01)
        return real_launch(sched, before)

    runner._launch = slow_launch
    engine = AsyncEngine(runner, tokenizer,
                         SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    engine.ahead_max_step_s = float("inf")
    waits: list[float] = []
    wait = engine.model_steps.wait_under_way

    def timed(timeout: float) -> None:
        t0 = time.perf_counter()
        wait(timeout)
        waits.append(time.perf_counter() - t0)

    engine.model_steps.wait_under_way = timed
    await engine.start()
    try:
        async def one(rid: str, n: int) -> int:
            req = Request(rid, prompt(9 + n, n), SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True))
            return len([t async for ev in engine.generate(req) for t in ev.token_ids])

        assert await asyncio.gather(*(one(f"w{i}", 30 + 4 * i) for i in range(3))) == [
            30, 34, 38]
    finally:
        await engine.stop()
    capped = sum(w >= 0.9 * HANDOFF_WAIT_S for w in waits)
    assert len(waits) > 20 and capped <= len(waits) // 10, (capped, len(waits))
