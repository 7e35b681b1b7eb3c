"""How long one engine step takes, from the step's shape: one definition of a step's features, and
an online model of step time fitted from the engine's own measured steps.

A step's shape (`StepShape`, read from a `SchedulerOutput`) gives seven features:

- `n_dec`: one-token rows (decodes); each samples, so each also pays an LM-head row;
- `dec_kv`: decode rows x the longest decode context, in thousands of tokens (the runner gathers
  every decode row's block table padded to the longest one);
- `pre_tok`: tokens in multi-token prefill chunks;
- `pre_attn`: sum over chunks of chunk length x context length, in millions (attention);
- `n_pre`: prefill chunks (each runs its own attention call per layer);
- `hinge`: max(0, all tokens - knot): the matmuls are weight-bound below the knot and compute-bound
  above it, so their cost per token changes there;
- `pre_ctx`: sum over chunks of the context each reads (start + length), in thousands: a chunk
  gathers and scans its whole cached context per layer whatever its length, so at 2k tokens of
  context even a 2-token chunk costs a sizeable share of a decode step, which `pre_attn` (chunk x
  context) prices near zero. Last, so a model stored with the first six reads as this one's
  with no context term.

Step seconds = intercept + coef . features. The simulator's calibrated model (`sim/stepmodel.py`)
fits the coefficients offline; `OnlineStepTimeModel` starts from such a fit and keeps following the
machine it runs on (a Kalman filter over the coefficients, see its docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from batcher.core.outputs import SchedulerOutput

FEATURES = ("n_dec", "dec_kv", "pre_tok", "pre_attn", "n_pre", "hinge", "pre_ctx")
DEFAULT_KNOT = 64


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on."""

    decode_rows: int = 0  # one-token rows in the step
    decode_ctx: int = 0  # longest decode context (tokens, rounded up to a block)
    prefill_tokens: int = 0  # tokens in multi-token prefill chunks
    prefill_attn: int = 0  # sum over chunks of chunk_len * (start_pos + chunk_len)
    prefill_chunks: int = 0
    prefill_ctx: int = 0  # sum over chunks of start_pos + chunk_len (the context each reads)

    @classmethod
    def of(cls, sched: SchedulerOutput, block_size: int = 16) -> StepShape:
        # NOTE: once per step over every row, so plain integers rather than `plus` (an object
        # per row); the same arithmetic.
        rows = ctx = tokens = attn = chunks = pctx = 0
        for s in sched.seqs:
            n = len(s.token_ids)
            if n == 1:
                rows += 1
                c = -(-(s.start_pos + 1) // block_size) * block_size
                if c > ctx:
                    ctx = c
            elif n > 1:
                end = s.start_pos + n
                tokens += n
                attn += n * end
                chunks += 1
                pctx += end
        return cls(rows, ctx, tokens, attn, chunks, pctx)

    def plus(self, num_tokens: int, start_pos: int, block_size: int = 16) -> StepShape:
        """This step with one more sequence computing `num_tokens` from `start_pos`. A one-token
        row is a decode row whatever its position: it is the same computation."""
        if num_tokens <= 0:
            return self
        if num_tokens == 1:
            ctx = -(-(start_pos + 1) // block_size) * block_size
            return StepShape(self.decode_rows + 1, max(self.decode_ctx, ctx), self.prefill_tokens,
                             self.prefill_attn, self.prefill_chunks, self.prefill_ctx)
        return StepShape(self.decode_rows, self.decode_ctx, self.prefill_tokens + num_tokens,
                         self.prefill_attn + num_tokens * (start_pos + num_tokens),
                         self.prefill_chunks + 1, self.prefill_ctx + start_pos + num_tokens)

    @property
    def decode_only(self) -> StepShape:
        return StepShape(self.decode_rows, self.decode_ctx)

    @property
    def is_empty(self) -> bool:
        return self.decode_rows == 0 and self.prefill_tokens == 0

    def features(self, knot: int = DEFAULT_KNOT) -> list[float]:
        """The model's features, in FEATURES order."""
        n_dec = self.decode_rows
        return [float(n_dec), n_dec * self.decode_ctx / 1e3, float(self.prefill_tokens),
                self.prefill_attn / 1e6, float(self.prefill_chunks),
                float(max(0, n_dec + self.prefill_tokens - knot)), self.prefill_ctx / 1e3]


@dataclass(frozen=True, slots=True)
class StepTimePrior:
    """A starting point for the online model: `intercept + coef . features` seconds."""

    intercept: float
    coef: tuple[float, ...]
    knot: int = DEFAULT_KNOT

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"a step-time prior needs {len(FEATURES)} coefficients")
        if self.intercept < 0 or any(c < 0 or not math.isfinite(c) for c in self.coef):
            raise ValueError("step-time coefficients must be finite and >= 0")


# `batcher sim calibrate` on the bundled SmolLM2-135M, bf16, 2-core AVX-512 CPU, 2 threads
# (workloads/step_time_cpu.json; a test keeps the two equal; the context term was measured
# separately, see the file's meta). Only a prior: the online model
# leaves it within seconds of steps on any other machine, model or device.
CPU_PRIOR = StepTimePrior(
    intercept=0.023765183619757164,
    coef=(0.0005259236047291508, 0.0031185666726693834, 0.0002690410319042769,
          0.32802099350423586, 0.002081775365930267, 0.0002469232409644153, 0.0033),
    knot=32,
)

# Feature values of an ordinary step, used to give a coefficient the prior fitted as zero a little
# room: a typical contribution of PRIOR_FLOOR_S seconds.
_TYPICAL = np.array([1.0, 32.0, 10.0, 256.0, 0.5, 1.0, 128.0, 1.0])
_PRIOR_FLOOR_S = 0.002
# Decode-only steps measured before they are predicted from those alone.
_MIN_DECODE_STEPS = 3
# Steps carrying decodes whose measured / predicted ratio is kept, and how many are needed before
# it is used; see `OnlineStepTimeModel.overrun`. The window is long enough that its 99th
# percentile is a ratio seen more than once, not a single outlier.
_OVERRUN_WINDOW = 128
_MIN_OVERRUN_STEPS = 8
# The overrun allowed for is at most this factor: past it the fit itself must catch up.
_MAX_OVERRUN = 1.5


def _prior_predict(prior: StepTimePrior, shape: StepShape) -> float:
    return prior.intercept + sum(c * x for c, x in zip(prior.coef, shape.features(prior.knot),
                                                        strict=True))


class _KalmanFit:
    """One Kalman filter over `(intercept, *coef)`; see `OnlineStepTimeModel`."""

    def __init__(self, prior: StepTimePrior, prior_rel_sd: float, prior_common_sd: float,
                 noise_rel_sd: float, drift_common: float, drift_each: float,
                 clip_sigma: float) -> None:
        theta = np.array([prior.intercept, *prior.coef], dtype=float)
        sd0 = theta * prior_rel_sd + _PRIOR_FLOOR_S / _TYPICAL
        self.theta = theta
        self.coef = theta.tolist()  # a plain-list copy: predict() is on the hot path
        self.n = 0
        self._p = np.diag(sd0**2) + prior_common_sd**2 * np.outer(theta, theta)
        self._p0_diag = np.diag(self._p).copy()
        self._q_each = np.diag((drift_each * sd0) ** 2)
        self._drift_common = drift_common
        self._noise = noise_rel_sd
        self._clip = clip_sigma

    def predict(self, features: list[float]) -> float:
        c = self.coef
        t = c[0]
        for ci, x in zip(c[1:], features, strict=True):
            t += ci * x
        return t

    def update(self, features: list[float], seconds: float) -> None:
        theta = self.theta
        # Drift, then cap the uncertainty at the prior's (a scalar shrink keeps P positive).
        p = self._p + self._q_each + (self._drift_common**2) * np.outer(theta, theta)
        ratio = float(np.max(np.diag(p) / self._p0_diag))
        if ratio > 1.0:
            p = p / ratio
        x = np.array([1.0, *features])
        pred = float(theta @ x)
        px = p @ x
        r = (self._noise * max(seconds, pred, 1e-6)) ** 2
        s = float(x @ px) + r
        limit = self._clip * math.sqrt(s)
        innovation = max(-limit, min(limit, seconds - pred))
        gain = px / s
        self.theta = np.maximum(theta + gain * innovation, 0.0)
        p = p - np.outer(gain, px)
        self._p = 0.5 * (p + p.T)
        self.coef = self.theta.tolist()
        self.n += 1


class OnlineStepTimeModel:
    """Step seconds from a step's shape, fitted online from measured steps.

    The coefficients (intercept first) are the state of a Kalman filter: each measured step is an
    observation `seconds = theta . [1, features]` with noise proportional to the step time (a
    20 ms step counts as much as a 200 ms one). Between observations the state may drift:
    a little per coefficient, and more along theta itself, a common scale, because what usually
    changes (another machine, a slower device, a busy neighbour) scales every cost at once; that
    common mode lets decode-only steps also rescale the prefill costs they cannot see. The
    prior itself is uncertain mostly along theta (the machine may be several times faster or
    slower overall; the relative costs are closer), so the first few steps of any kind rescale
    every coefficient, and a model that saw only small decode steps still extrapolates sensibly to
    a large batch. The uncertainty is capped at the prior's, so a direction that went unobserved for a long time
    (no prefill for an hour) does not make the first new observation swing the estimate wildly.
    A measurement far off the prediction (a stall of the OS) is clipped to `clip_sigma` standard
    deviations, so a single outlier moves the fit a little and a real change moves it step by
    step. Coefficients stay >= 0, so predictions grow with every feature.

    Two such filters run side by side: one over every step, and one over decode-only steps,
    which predicts decode-only steps once it has seen a few. While a long prompt is read, every
    step carries the same decodes and a similar chunk, so the first filter cannot tell the
    decodes' share from the chunk's; the decode-only filter keeps the running streams' steady
    step anchored to what was measured without prefill (the reference of the chunk budget).

    Not thread-safe: the engine observes and the scheduler predicts from the event loop only.
    """

    def __init__(self, prior: StepTimePrior = CPU_PRIOR, *, prior_rel_sd: float = 1.0,
                 prior_common_sd: float = 3.0, noise_rel_sd: float = 0.1,
                 drift_common: float = 0.05, drift_each: float = 0.003,
                 clip_sigma: float = 3.0) -> None:
        self._settings = (prior_rel_sd, prior_common_sd, noise_rel_sd, drift_common, drift_each,
                          clip_sigma)
        self._recorded: list[tuple[StepShape, float]] | None = None
        self._start(prior)

    def _start(self, prior: StepTimePrior) -> None:
        """Forget every observation; start from `prior`."""
        self.prior = prior
        self.knot = prior.knot
        self._all = _KalmanFit(prior, *self._settings)
        self._decode = _KalmanFit(prior, *self._settings)
        # Recent steps with decodes: [1, features] rows, measured seconds, decode-only or not;
        # `overrun` scores them against the fit as it is now.
        self._rows = np.zeros((_OVERRUN_WINDOW, len(_TYPICAL)))  # intercept + features
        self._seconds = np.zeros(_OVERRUN_WINDOW)
        self._decode_only = np.zeros(_OVERRUN_WINDOW, dtype=bool)
        self._kept = 0  # steps kept so far (the ring holds the last _OVERRUN_WINDOW)
        self._overrun: dict[float, float] = {}  # by quantile, until the next observation

    def start_recording(self) -> None:
        """Keep every step observed from now on, for `refit_recorded` (a calibration)."""
        self._recorded = []

    def refit_recorded(self, passes: int = 3, keep: bool = False) -> int:
        """Start again from the prior rescaled to the steps observed since `start_recording`,
        then learn those steps `passes` times over; returns how many there were. `keep`: go on
        recording (a later refit takes these steps and the next ones).

        A prior measured on another machine can be off by a factor of fifty (a CPU's prior on
        a GPU). Observed once each, a few dozen calibration steps move it only part of the way:
        each innovation is clipped, so that a stall moves the fit a little (see the class
        docstring). Rescaled first, by the median ratio of measured to the prior's prediction,
        the filter starts on the device's scale and the passes settle the relative costs."""
        steps, self._recorded = self._recorded or [], None
        if not steps:
            if keep:
                self._recorded = []
            return 0
        ratios = sorted(sec / p for shape, sec in steps
                        if (p := _prior_predict(self.prior, shape)) > 0)
        scale = ratios[len(ratios) // 2] if ratios else 1.0
        prior = StepTimePrior(self.prior.intercept * scale,
                              tuple(c * scale for c in self.prior.coef), self.prior.knot)
        self._start(prior)
        for _ in range(passes):
            for shape, sec in steps:
                self.observe(shape, sec)
        if keep:
            self._recorded = list(steps)
        return len(steps)

    @property
    def num_observations(self) -> int:
        return self._all.n

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(intercept, *coef) in FEATURES order, of the fit over every step."""
        return tuple(self._all.coef)

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape (0 for an empty step)."""
        if shape.is_empty:
            return 0.0
        features = shape.features(self.knot)
        if shape.prefill_tokens == 0 and self._decode.n >= _MIN_DECODE_STEPS:
            return self._decode.predict(features)
        return self._all.predict(features)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step. Empty steps and non-finite or non-positive times are ignored."""
        if shape.is_empty or not (seconds > 0 and math.isfinite(seconds)):
            return
        if self._recorded is not None:
            self._recorded.append((shape, seconds))
        features = shape.features(self.knot)
        if shape.decode_rows:
            i = self._kept % _OVERRUN_WINDOW
            self._rows[i, 0] = 1.0
            self._rows[i, 1:] = features
            self._seconds[i] = seconds
            self._decode_only[i] = shape.prefill_tokens == 0
            self._kept += 1
        self._overrun.clear()
        self._all.update(features, seconds)
        if shape.prefill_tokens == 0:
            self._decode.update(features, seconds)

    def overrun(self, quantile: float = 0.99) -> float:
        """How far steps carrying decodes (the steps a time target applies to) lately ran over
        their prediction: the `quantile` of measured / predicted over the last hundred or so,
        each predicted by the fit as it is now; 1.0 until a few were seen, at most 1.5.

        A fit of the mean leaves about half the steps over any time target it sizes chunks to,
        and a step's time varies around the fit (a neighbour's cache traffic, the chunk's exact
        context); sizing to `target / overrun()` keeps that quantile of steps within it. The
        default is the 99th: streams feel the slowest of their steps, and the scatter is random
        from step to step (uncorrelated with the chunk's size or the steps before it), so only a
        margin as wide as the scatter's tail keeps the tail in. Measured on the bundled model on
        a shared CPU, the 90th percentile left the slowest 1% of steps 10-15% over the target;
        the 99th keeps them within it, for 1.2-2.7x the steps to a long prompt's first token
        (chunks of 4-10 tokens instead of 6-14 beside 8 streams; more steps the noisier the
        machine, whose scatter the margin follows). Decode-only steps count too: they sample
        the same machine's scatter, so the first chunks after a quiet spell (no prefill for a
        while) already get a margin instead of none; once prompts are read, mixed steps fill the
        window, and a bias of the fit on them (the linear features cannot express everything)
        is absorbed at any scale."""
        got = self._overrun.get(quantile)
        if got is not None:
            return got
        n = min(self._kept, _OVERRUN_WINDOW)
        if n < _MIN_OVERRUN_STEPS:
            return 1.0
        # Each kept step against the fit as it is now (vectorised: once per step, not per
        # chunk asked for). Scored against the fit of its own time instead, the few steps a
        # fit takes to learn a change (a slower machine) would read as overruns of up to 2x
        # and hold the margin at its cap for a whole window after the fit caught up.
        rows, seconds = self._rows[:n], self._seconds[:n]
        predicted = rows @ self._all.theta
        if self._decode.n >= _MIN_DECODE_STEPS:
            predicted = np.where(self._decode_only[:n], rows @ self._decode.theta, predicted)
        ranked = np.sort(seconds[predicted > 0] / predicted[predicted > 0])
        if len(ranked) < _MIN_OVERRUN_STEPS:
            return 1.0
        # NOTE: never the single largest ratio: one stall would set the margin for the next
        # hundred steps; two such steps do.
        q = float(ranked[min(len(ranked) - 2, int(quantile * len(ranked)))])
        got = min(_MAX_OVERRUN, max(1.0, q))
        self._overrun[quantile] = got
        return got

    def max_chunk(self, target_s: float, shape: StepShape, start_pos: int, limit: int,
                  block_size: int = 16) -> int:
        """The largest chunk (0..limit tokens, computed from `start_pos`) that can join a step
        already holding `shape` while keeping its predicted time <= `target_s`."""
        if limit <= 1:
            # NOTE: a one-token chunk is a decode row (see `plus`), priced as one.
            fits = limit == 1 and self.predict(shape.plus(1, start_pos, block_size)) <= target_s
            return int(fits)
        if self.predict(shape.plus(2, start_pos, block_size)) > target_s:
            return 0
        lo, hi = 2, limit  # predict() grows with the chunk: coefficients are >= 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(shape.plus(mid, start_pos, block_size)) <= target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_prefill_tokens(self, target_s: float, decode_rows: int, decode_ctx: int,
                           prefill_context: int, limit: int = 1 << 16) -> int:
        """The largest prefill chunk from position `prefill_context`, in a step with these
        decodes, whose predicted step time stays <= `target_s` (0 if none does)."""
        return self.max_chunk(target_s, StepShape(decode_rows, decode_ctx), prefill_context,
                              limit)
