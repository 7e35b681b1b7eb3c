"""Step-time models: how long one engine step takes, from the step's composition alone.

A step's composition is read from a `SchedulerOutput` (pure Python, no torch):

- `n_dec`: one-token rows (decodes); each samples, so each also pays an LM-head row;
- `dec_kv`: decode rows x the longest decode context, in thousands of tokens (the runner gathers
  every decode row's block table padded to the longest one);
- `pre_tok`: tokens in multi-token prefill chunks;
- `pre_attn`: sum over chunks of chunk length x context length, in millions (causal attention);
- `n_pre`: prefill chunks (each runs its own attention call per layer);
- `hinge`: max(0, all tokens - knot): the matmuls are weight-bound below the knot and compute-bound
  above it, so their cost per token changes there.

`LinearStepModel` is `intercept + sum(coef * feature)` with non-negative coefficients, fitted by
`fit_linear` and stored as small JSON. `ConstantStepModel` (a fixed step time) is for tests, and
`RateStepModel` turns a source's prefill and decode rates into a step time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from batcher.core.outputs import SchedulerOutput

FEATURES = ("n_dec", "dec_kv", "pre_tok", "pre_attn", "n_pre", "hinge")
DEFAULT_KNOT = 64


class StepModel(Protocol):
    """Seconds one step of this composition takes (always > 0 for a non-empty step)."""

    def step_seconds(self, sched: SchedulerOutput) -> float: ...


def composition(sched: SchedulerOutput, block_size: int = 16) -> tuple[int, int, int, int, int]:
    """(decodes, longest decode context, prefill tokens, sum of chunk x context, chunks)."""
    n_dec = max_ctx = pre_tok = pre_attn = n_pre = 0
    for s in sched.seqs:
        n = len(s.token_ids)
        if n == 1:
            n_dec += 1
            if s.start_pos >= max_ctx:
                max_ctx = s.start_pos + 1
        else:
            pre_tok += n
            pre_attn += n * (s.start_pos + n)
            n_pre += 1
    max_ctx = -(-max_ctx // block_size) * block_size
    return n_dec, max_ctx, pre_tok, pre_attn, n_pre


def feature_row(n_dec: int, max_ctx: int, pre_tok: int, pre_attn: int, n_pre: int,
                knot: int = DEFAULT_KNOT) -> list[float]:
    """The model's features (in FEATURES order) for one composition."""
    return [float(n_dec), n_dec * max_ctx / 1e3, float(pre_tok), pre_attn / 1e6, float(n_pre),
            float(max(0, n_dec + pre_tok - knot))]


@dataclass(slots=True)
class LinearStepModel:
    """`intercept + coef . features` seconds; `meta` records where and how it was measured."""

    intercept: float
    coef: list[float]
    knot: int = DEFAULT_KNOT
    block_size: int = 16
    meta: dict = field(default_factory=dict)

    def step_seconds(self, sched: SchedulerOutput) -> float:
        c = self.coef
        n_dec, max_ctx, pre_tok, pre_attn, n_pre = composition(sched, self.block_size)
        t = (self.intercept + c[0] * n_dec + c[1] * (n_dec * max_ctx / 1e3) + c[2] * pre_tok
             + c[3] * (pre_attn / 1e6) + c[4] * n_pre)
        over = n_dec + pre_tok - self.knot
        return t + c[5] * over if over > 0 else t

    def predict_row(self, row: list[float]) -> float:
        return self.intercept + sum(c * x for c, x in zip(self.coef, row, strict=True))

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
    if data.get("kind") != "linear" or list(data.get("features", [])) != list(FEATURES):
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
