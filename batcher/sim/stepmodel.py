"""Step-time models: how long one engine step takes, from the step's composition alone.

The features of a step (decodes, their context, prefill tokens, chunk x context, chunks, a
hinge where the matmuls turn compute-bound, and the context the chunks read) are defined once, in `core/step_time.py`, and shared
with the engine's online model. `LinearStepModel` is `intercept + sum(coef * feature)` with
non-negative coefficients, fitted by `fit_linear` and stored as small JSON; it seeds the online
model (`prior()`). `ConstantStepModel` (a fixed step time) is for tests, and `RateStepModel` turns
a source's prefill and decode rates into a step time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from batcher.core.outputs import SchedulerOutput
from batcher.core.step_time import DEFAULT_KNOT, FEATURES, StepShape, StepTimePrior

__all__ = ["DEFAULT_KNOT", "FEATURES", "StepShape"]


class StepModel(Protocol):
    """Seconds one step of this composition takes (always > 0 for a non-empty step)."""

    def step_seconds(self, sched: SchedulerOutput) -> float: ...


def composition(sched: SchedulerOutput, block_size: int = 16) -> tuple[int, int, int, int, int]:
    """(decodes, longest decode context, prefill tokens, sum of chunk x context, chunks)."""
    sh = StepShape.of(sched, block_size)
    return (sh.decode_rows, sh.decode_ctx, sh.prefill_tokens, sh.prefill_attn,
            sh.prefill_chunks)


def feature_row(n_dec: int, max_ctx: int, pre_tok: int, pre_attn: int, n_pre: int,
                knot: int = DEFAULT_KNOT, pre_ctx: int = 0) -> list[float]:
    """The model's features (in FEATURES order) for one composition; `pre_ctx`: the sum of the
    chunks' contexts (`StepShape.prefill_ctx`)."""
    return StepShape(n_dec, max_ctx, pre_tok, pre_attn, n_pre, pre_ctx).features(knot)


@dataclass(slots=True)
class LinearStepModel:
    """`intercept + coef . features` seconds; `meta` records where and how it was measured."""

    intercept: float
    coef: list[float]
    knot: int = DEFAULT_KNOT
    block_size: int = 16
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A model fitted before the last features existed has no term for them.
        if len(self.coef) > len(FEATURES):
            raise ValueError(f"a linear step model has at most {len(FEATURES)} coefficients")
        self.coef = [*self.coef, *[0.0] * (len(FEATURES) - len(self.coef))]

    def step_seconds(self, sched: SchedulerOutput) -> float:
        return self.shape_seconds(StepShape.of(sched, self.block_size))

    def shape_seconds(self, shape: StepShape) -> float:
        return self.predict_row(shape.features(self.knot))

    def predict_row(self, row: list[float]) -> float:
        return self.intercept + sum(c * x for c, x in zip(self.coef, row, strict=True))

    def prior(self) -> StepTimePrior:
        """This fit as the starting point of an `OnlineStepTimeModel`."""
        return StepTimePrior(self.intercept, tuple(self.coef), self.knot)

    def to_json(self) -> str:
        return json.dumps({"kind": "linear", "features": list(FEATURES), **asdict(self)},
                          indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")


@dataclass(slots=True)
class ConstantStepModel:
    """Every non-empty step takes `seconds` (for analytic tests)."""

    seconds: float

    def step_seconds(self, sched: SchedulerOutput) -> float:
        return self.seconds


@dataclass(slots=True)
class ScaledStepModel:
    """Another model's step times times `factor` (a slower or busier machine)."""

    base: StepModel
    factor: float

    def step_seconds(self, sched: SchedulerOutput) -> float:
        return self.base.step_seconds(sched) * self.factor


@dataclass(slots=True)
class RateStepModel:
    """A source-style replica: a step costs `base_s` + decodes / `decode_rate` x `slots` share
    + prefill tokens / `prefill_rate`. With every slot decoding, the step takes
    `slots / decode_rate` (e.g. 64 / 2,500 = 25.6 ms), `base_s` of it fixed."""

    prefill_rate: float = 20_000.0
    decode_rate: float = 2_500.0
    slots: int = 64
    base_fraction: float = 0.5  # share of a full decode step that is fixed (weights read)

    def step_seconds(self, sched: SchedulerOutput) -> float:
        full = self.slots / self.decode_rate
        n_dec, _, pre_tok, _, _ = composition(sched)
        per_seq = full * (1 - self.base_fraction) / self.slots
        return full * self.base_fraction + n_dec * per_seq + pre_tok / self.prefill_rate


def load_step_model(spec: str) -> StepModel:
    """`const:SECONDS`, `source` (the source's rates) or a JSON file written by calibrate."""
    if spec.startswith("const:"):
        return ConstantStepModel(float(spec.split(":", 1)[1]))
    if spec == "source":
        return RateStepModel()
    data = json.loads(Path(spec).read_text())
    features = list(data.get("features", []))
    # A file from before the last features were added reads with no term for them.
    if (data.get("kind") != "linear" or len(features) < 6
            or features != list(FEATURES[:len(features)])
            or len(data.get("coef", [])) != len(features)):
        raise ValueError(f"{spec}: not a linear step model with features {FEATURES}")
    return LinearStepModel(float(data["intercept"]), [float(c) for c in data["coef"]],
                           int(data.get("knot", DEFAULT_KNOT)), int(data.get("block_size", 16)),
                           dict(data.get("meta", {})))


def fit_linear(rows: list[list[float]], seconds: list[float], knot: int = DEFAULT_KNOT,
               block_size: int = 16) -> LinearStepModel:
    """Least squares on relative error (each sample weighted by 1 / its time, so a 20 ms step
    counts as much as a 200 ms one), with non-negative coefficients: a feature whose coefficient
    comes out negative is dropped and the rest refitted."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / y
    active = list(range(x.shape[1]))
    while True:
        a = np.column_stack([np.ones(len(y)), x[:, active]]) * w[:, None]
        sol, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        neg = [active[i] for i, c in enumerate(sol[1:]) if c < 0]
        if not neg:
            break
        active = [i for i in active if i not in neg]
    coef = [0.0] * x.shape[1]
    for i, c in zip(active, sol[1:], strict=True):
        coef[i] = float(c)
    return LinearStepModel(max(0.0, float(sol[0])), coef, knot, block_size)


def fit_quality(model: LinearStepModel, rows: list[list[float]], seconds: list[float]
                ) -> dict[str, float]:
    """R^2 and mean / max absolute percentage error of `model` on these samples."""
    y = np.asarray(seconds, dtype=float)
    p = np.asarray([model.predict_row(r) for r in rows])
    ss_res = float(np.sum((y - p) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2)) or 1.0
    ape = np.abs(p - y) / y
    return {"r2": 1 - ss_res / ss_tot, "mape": float(ape.mean()), "max_ape": float(ape.max()),
            "n": float(len(y))}
