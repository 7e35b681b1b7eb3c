"""What admission learns from each engine step and asks of the engine's step-time model: one copy
for `batcher serve` and the simulator, so both admit on the same arithmetic.

- `decode_step_fn`: the step running streams get while a prompt is read (the TPOT check);
- `prefill_step_fn`: the prefill chunk the scheduler would put in one step beside so many decodes,
  and the model's price of that step (the TTFT prediction for a backlog bigger than the steps it
  measured, or paced differently);
- `step_observer`: feeds admission every step, with the model's price of it and whether prompt
  tokens that were there when it started were left for a later step.
"""

from __future__ import annotations

from collections.abc import Callable

from batcher.admission.admission import Admission
from batcher.core.outputs import SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.step_budget import PrefillAllowance, step_target
from batcher.core.step_time import OnlineStepTimeModel, StepShape


def decode_step_fn(model: OnlineStepTimeModel, min_chunk: int) -> Callable[[int, int], float]:
    """Predicted seconds of a step with `rows` decodes at context `ctx`."""

    def predict(rows: int, ctx: int) -> float:
        # The step the streams get while a prompt is read: the scheduler moves every pending
        # prefill by at least `min_chunk` tokens a step, whatever the decodes.
        return model.predict(StepShape(rows, ctx).plus(min_chunk, 0))

    return predict


def prefill_step_fn(scheduler: Scheduler, model: OnlineStepTimeModel
                    ) -> Callable[[int, int, int, int, bool | None], tuple[int, float, bool]]:
    """`(rows, ctx, tokens, prompt, paced) -> (chunk, seconds, paced)`: the prompt tokens, at
    most `tokens`, that one step carries beside `rows` decodes at context `ctx`, the model's price
    of that step, and whether the chunk is the time target's (`paced`) rather than the whole
    token budget. The scheduler gives the whole budget with no decodes, with a fixed budget, and
    while a burst fills its batch (the new request counted in); otherwise the time target's
    chunk, `min_prefill_chunk` when not even two tokens fit (a first-token deadline only raises
    it). `paced` given (not None) is taken as it is: a question asked again later about the
    same backlog. The chunk is priced at the mean position of the chunks of a prompt of
    `prompt` tokens (a long prompt's later chunks attend over more context). A paced chunk is
    remembered until the model observes another step."""
    config, block_size = scheduler.config, scheduler.kv.block_size
    cache: dict[tuple[int, int, int], int] = {}
    seen = [-1]

    def paced_chunk(rows: int, ctx: int, pos: int, budget: int) -> int:
        if seen[0] != model.num_observations:
            cache.clear()
            seen[0] = model.num_observations
        key = (rows, -(-ctx // block_size), pos // block_size)
        got = cache.get(key)
        if got is None:
            # The scheduler's own allowance for a step's first chunk (see `PrefillPacer`).
            decode = StepShape(rows, key[1] * block_size)
            target = step_target(model, decode, config.slo_tpot_s, config.max_step_slowdown)
            assert target is not None
            allowance = PrefillAllowance(model, target, decode, config.min_prefill_chunk,
                                         block_size)
            got = cache[key] = allowance.chunk(key[2] * block_size, budget)
        return got

    burst: list[object] = [None, False]

    def bursting() -> bool:
        # NOTE: asked once per stream ahead by one prediction: the scan is done once per
        # 10 ms of the same queues (a burst's window is a second).
        pacer, running, waiting = scheduler.pacer, scheduler.running, scheduler.waiting
        if pacer is None:
            return True  # nothing paces prefill: the whole budget
        now = scheduler.clock()
        key = (model.num_observations, len(running), len(waiting), int(now * 100))
        if burst[0] != key:
            burst[0], burst[1] = key, (len(running) < config.max_num_seqs
                                       and pacer.one_burst(running, waiting, now))
        return bool(burst[1])

    def step(rows: int, ctx: int, tokens: int, prompt: int,
             paced: bool | None) -> tuple[int, float, bool]:
        rows = max(0, rows)
        budget = max(1, config.max_num_batched_tokens - rows)
        if paced is None:
            paced = rows > 0 and not bursting()
        paced = paced and rows > 0 and config.prefill_budget == "time"
        span = min(max(0, prompt), max(0, tokens))
        pos = max(0, span - budget) // 2
        chunk = min(max(0, tokens), paced_chunk(rows, ctx, pos, budget) if paced else budget)
        pos = max(0, span - chunk) // 2
        shape = StepShape(rows, ctx if rows else 0).plus(chunk, pos, block_size)
        return chunk, model.predict(shape), paced

    return step


def prefill_left(scheduler: Scheduler, started: float) -> bool:
    """Prompt tokens that were there when a step began at `started` wait for a later step: a
    request read in chunks, or one that arrived before the step and has not started (one that
    arrived during the step was not the step's to take)."""
    if any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
        return True
    return any(r.arrival_time <= started for r in scheduler.waiting)


def step_observer(admission: Admission, scheduler: Scheduler, model: OnlineStepTimeModel,
                  decode_step: Callable[[int, int], float]
                  ) -> Callable[[SchedulerOutput, float], None]:
    """`observe(sched, seconds)`, to call after each step is applied."""
    block_size = scheduler.kv.block_size

    def observe(sched: SchedulerOutput, seconds: float) -> None:
        # Every step counts, decodes and all: admission predicts from the prefill rate the
        # scheduler achieves in the steps it really runs. Each step with decodes is also
        # compared with what the TPOT check would have predicted for its decode rows, so the
        # check follows the step's measured wall time (a busy machine, the event loop's share,
        # a step-time model still catching up) and takes only the shape from the model.
        shape = StepShape.of(sched, block_size)
        modelled = decode_step(shape.decode_rows, shape.decode_ctx) if shape.decode_rows else None
        pre = shape.prefill_tokens > 0
        left = prefill_left(scheduler, scheduler.clock() - seconds) if pre else True
        admission.observe_step(seconds, shape.prefill_tokens, scheduler.has_unfinished(),
                               shape.decode_rows, modelled, model.predict(shape) if pre else None,
                               left)

    return observe
