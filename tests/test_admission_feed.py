"""What admission asks of the engine's scheduler and step-time model (`batcher.admission.feed`),
against the real scheduler on a simulated clock: the chunk a backlog would be read in, and whether
a step left prompt tokens that were there when it started."""

from __future__ import annotations

from batcher.admission.feed import prefill_left, prefill_step_fn
from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import RunnerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.step_time import OnlineStepTimeModel, StepShape
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams

BS = 16
BUDGET = 320


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(clock: Clock) -> tuple[Scheduler, OnlineStepTimeModel]:
    model = OnlineStepTimeModel()
    kv = KVCacheManager(2048, BS, enable_prefix_caching=False)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET, burst_window_s=1.0)
    return Scheduler(cfg, kv, clock=clock, step_time=model), model


def add(s: Scheduler, rid: str, prompt_len: int, at: float) -> None:
    ids = [(i * 31 + len(rid)) % 4000 + 10 for i in range(prompt_len)]
    s.add_request(Request(rid, ids, SamplingParams(max_tokens=64, ignore_eos=True),
                          arrival_time=at))


def run_step(s: Scheduler) -> None:
    out = s.schedule()
    ids = [q.request_id for q in out.seqs if q.sample]
    s.update(out, RunnerOutput(ids, [7] * len(ids), []))


def test_no_decodes_get_the_whole_budget_and_streams_the_time_targets_chunk() -> None:
    clock = Clock()
    s, model = scheduler(clock)
    step = prefill_step_fn(s, model)
    chunk, seconds, paced = step(0, 0, 1000, 40, None)
    assert (chunk, paced) == (BUDGET, False)
    # Forty-token prompts: every chunk starts near the front of its prompt.
    assert seconds == model.predict(StepShape().plus(BUDGET, 0, BS))
    # One long prompt: its chunks are priced at their mean position, dearer.
    assert step(0, 0, 4000, 4000, None)[1] > seconds
    assert step(0, 0, 40, 40, None)[0] == 40  # never more than there is
    # Two streams decoding, nothing arriving together: the time target sizes the chunk.
    add(s, "a", 20, 0.0)
    clock.now = 5.0
    add(s, "b", 20, 5.0)
    for _ in range(3):
        run_step(s)
    chunk, seconds, paced = step(2, 32, 1000, 40, None)
    assert paced and s.config.min_prefill_chunk <= chunk < BUDGET - 2
    # Priced at the mean position of a 40-token prompt's chunks.
    assert seconds == model.predict(StepShape(2, 32).plus(chunk, max(0, 40 - chunk) // 2, BS))


def test_a_burst_filling_its_batch_lifts_the_time_target() -> None:
    """Three requests that arrived together, and the one asking now: a burst (the scheduler
    gives prefill the whole budget while it fills), so the chunk is the budget's."""
    clock = Clock()
    s, model = scheduler(clock)
    for i in range(3):
        add(s, f"r{i}", 20, 0.0)
    clock.now = 0.2
    run_step(s)  # all three read and decoding
    step = prefill_step_fn(s, model)
    chunk, _, paced = step(3, 32, 1000, 40, None)
    assert (chunk, paced) == (BUDGET - 3, False)
    clock.now = 3.0  # long after they arrived: the streams' target again
    assert step(3, 32, 1000, 40, None)[2]
    assert not step(3, 32, 1000, 40, False)[2]  # as it was when first asked


def test_prompt_tokens_left_count_only_what_was_there_when_the_step_began() -> None:
    clock = Clock()
    s, _ = scheduler(clock)
    add(s, "long", BUDGET + 100, 0.0)
    clock.now = 1.0
    run_step(s)  # the budget's chunk of it: the rest is left
    assert prefill_left(s, started=1.0)
    run_step(s)
    run_step(s)  # now decoding
    assert not prefill_left(s, started=1.0)
    clock.now = 2.0
    add(s, "late", 20, 2.0)  # arrived while a step that began at 1.5 ran
    assert not prefill_left(s, started=1.5)
    assert prefill_left(s, started=2.5)
