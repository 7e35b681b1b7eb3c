"""How much prefill one step may carry: chunks sized by the step-time model so that a step with
decodes in it stays within the running streams' time-per-token target.

A fixed token budget cannot protect streams: a chunk's cost grows with its context (attention) and
the balance between a prefill token and a decode row differs by model and device. So each step,
the scheduler asks for the largest chunk whose predicted step time stays within the target:

- the target is the TPOT SLO when one is set, else `max_slowdown` times the steady step: the
  decode-only step of the batch the streams are about to be in (they, plus the requests waiting
  to start, up to `max_num_seqs`, at the streams' current context). Running streams then
  slow by at most that factor while a prompt is read. Counting the waiting requests matters when
  many arrive at once: two streams' 30 ms step would otherwise hold thirty waiting prompts to
  15 ms of prefill a step, and the batch (and throughput) would grow at a crawl, although those
  streams are about to share their steps with the thirty anyway. A prompt already being read is
  not counted: its own chunks would be sized by the row it adds once read, a few percent above
  the streams' steady step for as long as the prompt takes;
- the minimum chunk is defined in time, not tokens: the first prefill of a step (the
  longest-waiting one the scheduler reaches) gets whatever fits the target, however small, and
  only when not even two tokens fit does it get `min_chunk` tokens anyway, so a long prompt
  progresses every step. A token minimum applied regardless would break the target on its own
  at long context: every chunk attends over its whole context, so at 2k tokens of context a
  16-token chunk costs most of a steady decode step on a CPU;
- chunks are sized to the target divided by the model's recent overrun (`OnlineStepTimeModel.
  overrun`: the 99th percentile of measured / predicted over recent steps): a fit of the
  mean leaves about half the steps over whatever it is sized to, and streams feel the slow steps;
- with no decodes in the step there is no time target: prefill gets the whole token budget, and
  TTFT is as short as the hardware allows;
- nor is there while a burst fills (the scheduler's `burst_window_s`: at least four requests are
  there, every one arrived within a second of the first, and some wait to start): the streams
  are the burst's first few, about to share their steps with the rest, and reading the rest a
  small chunk a step fills the batch in ten times the steps, each with the step's fixed cost: a
  burst of 64 lost 16% of its throughput that way. Those first streams see the whole budget's
  long steps for the few steps the fill takes; streams already running when a burst arrives
  keep their target, since the burst's requests did not arrive with them;
- a first token has a deadline too (`deadline_chunk`): with a TTFT SLO, a prompt not yet
  answered gets at least its remainder spread over the steps left before its pace point (a
  share of the SLO after its arrival). Short prompts then need a few tokens a step on top of
  what the streams' target allows, instead of waiting at two tokens a step for seconds. A
  prompt too long to be read within the SLO even at the whole token budget from its first token
  (`seconds_to_read`) misses whatever it is given: it gets the streams' target, so the streams
  are not stalled for it, but no less than an even share of its prompt a step, due a few times
  its whole-budget reading after arrival (`prefill_pacing.LONG_READ_PACE`): where the target
  leaves no room (a slow or noisy machine), two tokens a step would read 2,000 in minutes. A prompt late only because it waited (behind other prompts,
  or sharing steps with them) yields the same way only to another prompt whose first token can
  still be on time; with none, it gets the whole budget: that is a backlog, and a backlog read
  at the streams' target drains at a third of the rate (each small chunk pays a step's fixed
  cost and rereads its context), so the queue behind it grows and every later prompt is late
  too (docs/capacity.md, long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.core.step_time import OnlineStepTimeModel, StepShape


def step_target(model: OnlineStepTimeModel, decode: StepShape, slo_tpot_s: float | None,
                max_slowdown: float, batch_rows: int | None = None) -> float | None:
    """Seconds a step carrying these decodes may take; None when it carries none. `batch_rows`:
    the rows of the steady batch (default: the decodes alone)."""
    if decode.decode_rows == 0:
        return None
    if slo_tpot_s is not None:
        return slo_tpot_s
    rows = max(decode.decode_rows, batch_rows or 0)
    return max_slowdown * model.predict(StepShape(rows, decode.decode_ctx))


@dataclass(slots=True)
class PrefillAllowance:
    """One step's prefill allowance. `chunk()` sizes the next chunk, `take()` books it."""

    model: OnlineStepTimeModel
    target_s: float
    shape: StepShape  # the step so far: all its decodes, then each chunk booked
    min_chunk: int
    block_size: int = 16
    booked: int = 0  # chunks booked so far
    # What chunks are sized to: the target over the model's recent overrun of steps, so
    # that most steps, not only the average one, stay within the target.
    plan_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.plan_s = self.target_s / self.model.overrun()

    def chunk(self, start_pos: int, limit: int) -> int:
        """Tokens (0..limit) for a chunk computed from `start_pos`: the largest within the target
        (planned at `plan_s`); for the step's first chunk, `min_chunk` when none fits."""
        n = self.model.max_chunk(self.plan_s, self.shape, start_pos, limit, self.block_size)
        if n == 0 and self.booked == 0:
            n = min(self.min_chunk, limit)
        return n

    def take(self, num_tokens: int, start_pos: int) -> None:
        self.shape = self.shape.plus(num_tokens, start_pos, self.block_size)
        self.booked += 1

    def seconds_to_read(self, start_pos: int, end_pos: int, chunk: int) -> float:
        """Predicted seconds to read a prompt's positions `start_pos`..`end_pos` in chunks of
        `chunk` beside this step's decodes (each chunk priced at its own context): from 0, the
        soonest a prompt's first token can come, queueing aside."""
        if end_pos <= start_pos or chunk <= 0:
            return 0.0
        decodes = self.shape.decode_only
        seconds, pos = 0.0, start_pos
        while pos < end_pos:
            n = min(chunk, end_pos - pos)
            seconds += self.model.predict(decodes.plus(n, pos, self.block_size))
            pos += n
        return seconds

    def step_with(self, start_pos: int, num_tokens: int) -> float:
        """Predicted seconds of this step with one more chunk of `num_tokens` from `start_pos`."""
        return self.model.predict(self.shape.plus(num_tokens, start_pos, self.block_size))

    @property
    def predicted_s(self) -> float:
        """The step's predicted time with what was booked."""
        return self.model.predict(self.shape)


def deadline_chunk(remaining: int, time_left_s: float, step_s: float, limit: int) -> int:
    """Tokens a prompt with `remaining` tokens to compute must get this step to be done within
    `time_left_s`, one chunk per step of `step_s` seconds: the remainder spread evenly over the
    steps left, all of it when at most one is left; never more than `limit`."""
    if remaining <= 0 or limit <= 0:
        return 0
    steps = int(time_left_s / step_s) if step_s > 0 else 0
    if steps <= 1:
        return min(remaining, limit)
    return min(limit, -(-remaining // steps))
