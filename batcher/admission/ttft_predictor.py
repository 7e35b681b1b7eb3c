"""Time to first token for a request arriving now, predicted from the prefill work ahead of it and
corrected online by the TTFTs the server actually delivers.

    predicted = correction x (step_s + max((ahead + own) / rate,
                                           steps_to_slot x step_s + own / rate))

- `ahead`: prompt tokens not yet computed of every request the scheduler will prefill before the
  new one: all running requests (they are served first, whatever their priority), then waiting
  requests of the same or a higher priority (the queue is ordered by priority, then arrival).
  A running request that is still prefilling in chunks counts with what it has left; a preempted
  one counts its whole recompute.
- `rate`: prefill tokens the scheduler really computes per second of wall time in steps that carry
  prefill, measured separately for each number of decode rows riding along (in power-of-two
  buckets): the scheduler shrinks prefill chunks to protect running streams, so the rate with 40
  streams decoding is a fraction of the rate on a quiet server. The request is predicted at the
  rate for the streams that will be decoding while it waits (those running and those queued ahead
  of it). The event loop's own time between steps counts too. Time-decayed sums over the last few
  seconds (`RATE_TAU_S`), so a slower machine, a bigger model or a new batch shape shows up within
  seconds.
  A step has a fixed cost, whatever its prefill (the decodes beside it, the model's per-step
  overhead), so the rate depends on how many tokens a step carries: steps that each read one short
  prompt, because no more was there, achieve a fraction of the rate of the steps a backlog fills.
  So work ahead beyond the measured steps' mean chunk is predicted in the chunk the scheduler
  would give it (`prefill_step`: the whole token budget with no decodes or while a burst fills,
  the time target's chunk beside streams), priced by the shared step-time model and scaled by how
  the measured steps compared with the model's price for them; never below the rate measured.
  A time target's chunk is used only where the measured steps mostly took all the prefill there
  was: where the target's chunks were their limit, their measured rate is that chunk's.
- `steps_to_slot`: with every sequence slot held, the decode steps until one frees for this
  request (running requests end after at most their max_tokens; requests queued ahead take the
  first slots that open).
- `step_s`: the mean step, wall time (a new request waits for the step in progress).
- `correction`: the median of actual / predicted TTFT over recently admitted requests, each
  compared at its first token with what was predicted when it was admitted. Whatever the simple
  model misses (decode rows slowing steps, slots held by long generations, a shared CPU) is
  learned here instead of being tuned by hand. The median, not a high percentile: the prediction
  is centred, and how far below the SLO to admit, given how much delivered TTFTs scatter, is
  admission's controller's to find (`slo_limit.SloLimit`), from the misses themselves. A high
  percentile here would both react only after misses and, after one burst of them, keep
  refusing work the server could serve for as long as it stays in the window.
  A prediction is rescaled by any change of the measured rate between admission and first token
  before it is compared: the rate is the raw model's to follow, so a slower machine does not
  leave the correction pessimistic once the rate has caught up.

Pure Python (no torch): the server and the simulator feed it the same observations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batcher.core.backlog import Backlog

# Time constant (s) of the prefill-rate and step-time averages: long enough to span a few steps of
# a slow CPU step, short enough to follow a change of machine or load within a few seconds.
RATE_TAU_S = 2.0
# Steps of a bucket that took all the prefill waiting (none was left for the next step), as a
# share of its steps, above which its chunks say nothing of the scheduler's limit: a bigger
# backlog is predicted in the chunk `prefill_step` gives it.
DRAINED_SHARE = 0.5
# A bucket of the prefill rate with no step for this long is stale (see `prefill_rate_with`).
STALE_S = RATE_TAU_S
# Recent TTFT observations the correction is taken from: at most this many, none older than
# CORRECTION_WINDOW_S unless fewer than CORRECTION_MIN remain (a quiet server keeps its evidence).
CORRECTION_SAMPLES = 32
CORRECTION_WINDOW_S = 5.0
CORRECTION_MIN = 8
CORRECTION_QUANTILE = 0.5
# The correction makes a prediction at most this much more hopeful than the model: evidence that
# the model was more pessimistic than that comes from requests admitted while the machine was
# slower than by the time they ran (the rates follow a speed-up within a few seconds, not at
# once), and acting on it admits, all at once, a burst that then misses together.
CORRECTION_FLOOR = 1.0
# One observation may move the model at most this far either way: a request that stalled on
# something else (a preemption, a paused process) must not make the next hundred look free or
# hopeless.
RATIO_CLAMP = (0.25, 4.0)


@dataclass(slots=True)
class _Decayed:
    """Sum of values with weights decaying as exp(-age / tau)."""

    tau: float
    value: float = 0.0
    last: float | None = None

    def add(self, now: float, x: float) -> None:
        if self.last is not None and now > self.last:
            self.value *= math.exp(-(now - self.last) / self.tau)
        self.last = now if self.last is None else max(now, self.last)
        self.value += x


@dataclass(slots=True)
class _PrefillSteps:
    """Decayed sums over the steps of one bucket that carried prefill."""

    tokens: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))
    seconds: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))
    steps: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))
    # Steps that took all the prefill there was (none left for the next step).
    drained: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))
    # The steps the step-time model priced: their wall seconds, and the model's.
    priced: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))
    modelled: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S))

    def add(self, now: float, tokens: int, seconds: float, modelled_s: float | None,
            drained: bool) -> None:
        self.tokens.add(now, float(tokens))
        self.seconds.add(now, seconds)
        self.steps.add(now, 1.0)
        self.drained.add(now, 1.0 if drained else 0.0)
        if modelled_s is not None and modelled_s > 0:
            self.priced.add(now, seconds)
            self.modelled.add(now, modelled_s)

    @property
    def measured(self) -> bool:
        return self.tokens.value > 0 and self.seconds.value > 0 and self.steps.value > 0

    @property
    def chunk(self) -> float:
        """Mean prefill tokens a step."""
        return self.tokens.value / self.steps.value

    @property
    def wall_over_model(self) -> float | None:
        """These steps' wall time over the step-time model's price for them."""
        if self.modelled.value <= 0 or self.priced.value <= 0:
            return None
        return self.priced.value / self.modelled.value


# `(rows, ctx, tokens, prompt, paced) -> (chunk, seconds, paced)`: of `tokens` of prompt, the
# longest prompt `prompt` tokens, the chunk the scheduler would put in one step beside `rows`
# decodes whose longest context is `ctx`, the step-time model's price of that step, and whether
# the chunk is the streams' time target's rather than the whole token budget (given, or None: as
# the scheduler would decide now; see `batcher.admission.feed.prefill_step_fn`).
PrefillStepFn = Callable[[int, int, int, int, "bool | None"], tuple[int, float, bool]]
# `TtftPredictor.rate_query`: rows, tokens, context, longest prompt, paced.
RateQuery = tuple[int, float, int, int, "bool | None"]


@dataclass(slots=True)
class TtftPredictor:
    """Feed it every engine step (`observe_step`) and every admitted request's first token
    (`observe_ttft`); ask it `predict(now, backlog, priority, own_tokens)`. Times are on the
    caller's clock."""

    _tokens: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    _seconds: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    # The scheduler's chunk and its step's price beside so many decodes; None: only the chunks
    # measured (no extrapolation to a bigger backlog).
    prefill_step: PrefillStepFn | None = None
    # By bucket of decode rows in the step (`_bucket`).
    _by_rows: dict[int, _PrefillSteps] = field(default_factory=dict, repr=False)
    _step_sum: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    _step_n: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    # Wall time of steps over what the step-time model predicted for them: what a stream waits
    # per token beyond the model's own time (the event loop's share, a busy machine).
    _wall: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    _modelled: _Decayed = field(default_factory=lambda: _Decayed(RATE_TAU_S), repr=False)
    _last_end: float | None = field(default=None, repr=False)
    _last_prefill: float | None = field(default=None, repr=False)
    _pending: bool = field(default=False, repr=False)
    _ratios: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=CORRECTION_SAMPLES), repr=False)
    num_ttft_observations: int = 0

    # -- observations --------------------------------------------------------------------------

    def observe_step(self, now: float, seconds: float, prefill_tokens: int,
                     pending_after: bool, decode_rows: int = 0,
                     modelled_s: float | None = None, step_modelled_s: float | None = None,
                     prefill_left: bool = True) -> None:
        """One engine step ended at `now` after `seconds` of model time, having computed
        `prefill_tokens` prompt tokens next to `decode_rows` decodes; `pending_after`: the engine
        still has work, so the next step follows at once; `modelled_s`: what the step-time model
        predicted for its decodes, `step_modelled_s` for the whole step; `prefill_left`: prompt
        tokens that were there when it started still wait (its chunks were the scheduler's limit,
        not all there was). While the engine was busy since the previous step, the whole wall
        time between the two step ends counts as this step's (the event loop's share delays first
        tokens and every stream's next token too)."""
        if seconds <= 0:
            return
        wall = seconds
        if self._pending and self._last_end is not None and now > self._last_end:
            wall = max(seconds, now - self._last_end)
        self._step_sum.add(now, wall)
        self._step_n.add(now, 1.0)
        if modelled_s is not None and modelled_s > 0:
            self._wall.add(now, wall)
            self._modelled.add(now, modelled_s)
        if prefill_tokens > 0:
            self._last_prefill = now
            self._tokens.add(now, float(prefill_tokens))
            self._seconds.add(now, wall)
            b = _bucket(decode_rows)
            sums = self._by_rows.get(b)
            if sums is None:
                sums = self._by_rows[b] = _PrefillSteps()
            sums.add(now, prefill_tokens, wall, step_modelled_s, not prefill_left)
        self._last_end = now
        self._pending = pending_after

    def observe_ttft(self, now: float, predicted_s: float, actual_s: float) -> None:
        """An admitted request's first token came `actual_s` after admission, where
        `predicted_s` had been predicted (uncorrected, see `predict_raw`)."""
        if not (predicted_s > 0 and actual_s > 0):
            return
        lo, hi = RATIO_CLAMP
        self._ratios.append((now, min(hi, max(lo, actual_s / predicted_s))))
        self.num_ttft_observations += 1

    # -- estimates -----------------------------------------------------------------------------

    @property
    def prefill_rate(self) -> float | None:
        """Prefill tokens per wall second of the steps that carried prefill (decodes riding
        along included), or None before any."""
        if self._tokens.value <= 0 or self._seconds.value <= 0:
            return None
        return self._tokens.value / self._seconds.value

    def prefill_rate_with(self, decoding: int, tokens: float = 0.0, context: int = 0,
                          prompt: int = 0, paced: bool | None = None) -> float | None:
        """The prefill rate for `tokens` of prompt, the longest prompt `prompt` tokens, in steps
        carrying about `decoding` decode rows (the longest at `context`); `paced`: whether the
        scheduler holds prefill to the streams' time target (None: as it would now). That
        bucket's when measured, else the nearest measured bucket with more rows (a lower rate,
        the safe side), else the nearest with fewer; None before any measurement. Buckets
        measured within the last `STALE_S` of steps are preferred: a decayed average stops moving
        when its steps stop coming, so a bucket last seen while the machine was slower would go
        on saying so. Where the bucket's steps mostly took all the prefill there was, `tokens`
        beyond their mean chunk are predicted in the bigger chunk `prefill_step` gives them (see
        the module docstring)."""
        want = _bucket(decoding)
        if not self._by_rows:
            return None
        last = self._last_end if self._last_end is not None else 0.0
        fresh = [b for b, sums in self._by_rows.items()
                 if sums.tokens.last is not None and sums.tokens.last >= last - STALE_S]
        pool = fresh or list(self._by_rows)
        above = [b for b in pool if b >= want]
        b = min(above) if above else max(pool)
        sums = self._by_rows[b]
        if not sums.measured:
            return self.prefill_rate
        rate = sums.tokens.value / sums.seconds.value
        scale = sums.wall_over_model
        if tokens > sums.chunk and scale is not None and self.prefill_step is not None:
            chunk, step_s, paced = self.prefill_step(decoding, context, math.ceil(tokens),
                                                     prompt, paced)
            # NOTE: the measured chunks stand for paced ones unless they took all there was.
            drained = sums.drained.value > DRAINED_SHARE * sums.steps.value
            if chunk > sums.chunk and step_s > 0 and (drained or not paced):
                rate = max(rate, chunk / (step_s * scale))
        return rate

    def rate_query(self, backlog: Backlog, priority: str, own_tokens: int) -> RateQuery:
        """`prefill_rate_with`'s arguments for a request of `priority` with `own_tokens` of
        prompt: the streams decoding while it waits, the tokens to prefill up to its own, the
        context, the longest prompt and whether prefill is paced now. Asked again at its first
        token (pacing as it was at admission, not as it is then), the rate tells how far the
        model's view of the same backlog moved meanwhile."""
        rows, tokens = backlog.decoding_while_waiting(priority), backlog.ahead(priority) + max(
            0, own_tokens)
        prompt = max(backlog.longest_prompt, own_tokens)
        paced = None if self.prefill_step is None else self.prefill_step(
            rows, backlog.max_context, tokens, prompt, None)[2]
        return rows, float(tokens), backlog.max_context, prompt, paced

    @property
    def prefill_stale(self) -> bool:
        """No step has carried prefill for `STALE_S` of steps: every prefill rate is old news
        (measured while the machine, or the scheduler's chunk sizing, may have been different),
        and only a prompt that is admitted can renew it."""
        if self._last_end is None:
            return False
        return self._last_prefill is None or self._last_end - self._last_prefill > STALE_S

    @property
    def step_s(self) -> float:
        """Mean wall time of a recent step (0 before any)."""
        return self._step_sum.value / self._step_n.value if self._step_n.value > 0 else 0.0

    @property
    def wall_factor(self) -> float:
        """Recent steps' wall time over their modelled time (1 before any, never below 1)."""
        if self._modelled.value <= 0:
            return 1.0
        return max(1.0, self._wall.value / self._modelled.value)

    def correction(self, now: float) -> float:
        """The CORRECTION_QUANTILE of recent actual / predicted ratios, at least CORRECTION_FLOOR;
        1 before CORRECTION_MIN."""
        ratios = self._ratios
        while len(ratios) > CORRECTION_MIN and now - ratios[0][0] > CORRECTION_WINDOW_S:
            ratios.popleft()
        if len(ratios) < CORRECTION_MIN:
            return 1.0
        ordered = sorted(r for _, r in ratios)
        return max(CORRECTION_FLOOR,
                   ordered[min(len(ordered) - 1, int(CORRECTION_QUANTILE * len(ordered)))])

    def predict_raw(self, backlog: Backlog, priority: str, own_tokens: int) -> float | None:
        """Seconds until a request of `priority` with `own_tokens` of prompt, arriving now, gets
        its first token, before correction; None until a prefill rate is measured. The later of
        two bounds: prefill (everything ahead, then its own prompt, at the achieved rate) and
        slots (a free slot, then its own prompt)."""
        prompt = max(backlog.longest_prompt, own_tokens)
        rate = self.prefill_rate_with(backlog.decoding_while_waiting(priority), own_tokens,
                                      backlog.max_context, prompt)
        if rate is None:
            return None
        own = max(0, own_tokens) / rate
        by_prefill = self._prefill_s(backlog, priority, backlog.ahead(priority) + own_tokens,
                                     prompt)
        slot_steps = backlog.steps_to_slot(priority)
        # NOTE: with a slot open now the prefill bound covers its own prompt already.
        by_slot = slot_steps * self.step_s + own if slot_steps > 0 else 0.0
        return self.step_s + max(by_prefill, by_slot)

    def _prefill_s(self, backlog: Backlog, priority: str, tokens: float,
                   prompt: int = 0) -> float:
        """Seconds to prefill `tokens` from now, the rate rising as running streams end: each
        decodes for at most its `steps_left` more steps, and the scheduler gives prefill more of
        a step with fewer decodes beside it. Streams queued ahead are counted as decoding
        throughout (they start as soon as they are prefilled)."""
        n = len(backlog.steps_left)
        # Streams whose end is not known (none, from the scheduler) decode throughout too.
        staying = max(0, backlog.decoding_while_waiting(priority) - backlog.running) + max(
            0, backlog.running - n)
        ctx = backlog.max_context
        elapsed = 0.0
        done_steps = 0
        for i, steps in enumerate(backlog.steps_left):  # ascending: streams end one by one
            span = (steps - done_steps) * self.step_s
            if span <= 0:
                continue
            rate = self.prefill_rate_with(n - i + staying, tokens, ctx, prompt) or 1.0
            if tokens <= rate * span:
                return elapsed + tokens / rate
            tokens -= rate * span
            elapsed += span
            done_steps = steps
        return elapsed + tokens / (self.prefill_rate_with(staying, tokens, ctx, prompt) or 1.0)

    def predict(self, now: float, backlog: Backlog, priority: str, own_tokens: int
                ) -> float | None:
        """`predict_raw` times the correction learned from delivered TTFTs."""
        raw = self.predict_raw(backlog, priority, own_tokens)
        return None if raw is None else raw * self.correction(now)

    def quiet_prefill_s(self, now: float, tokens: float) -> float | None:
        """Predicted seconds to prefill `tokens` at the best rate measured (as a rule, with no
        decodes beside them): how long a prompt is in itself, whatever else the server is doing."""
        rates = [v.tokens.value / v.seconds.value for v in self._by_rows.values()
                 if v.seconds.value > 0]
        if not rates:
            return None
        return self.correction(now) * max(0.0, tokens) / max(rates)

    def drain_s(self, now: float, tokens: float) -> float | None:
        """Predicted seconds to prefill `tokens` (the Retry-After arithmetic)."""
        rate = self.prefill_rate
        return None if rate is None else self.correction(now) * max(0.0, tokens) / rate


def _bucket(rows: int) -> int:
    """0 for no rows, then one bucket per power of two: 1, 2-3, 4-7, 8-15, ..."""
    return max(0, rows).bit_length()
