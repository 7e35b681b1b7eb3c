"""The online step-time model: the shared step features, learning a known step-time formula from
measured steps, following a change of machine mid-run, and the largest chunk under a target."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.step_time import (
    CPU_PRIOR,
    FEATURES,
    OnlineStepTimeModel,
    StepShape,
    StepTimePrior,
)
from batcher.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def truth(shape: StepShape, scale: float = 1.0) -> float:
    """A known step-time formula, unlike the prior: a faster device where a prefill token is
    cheap next to a decode row's context."""
    f = shape.features(CPU_PRIOR.knot)
    coef = (2e-4, 1.5e-3, 6e-5, 0.08, 1e-3, 5e-5, 1.2e-3)
    return scale * (0.008 + sum(c * x for c, x in zip(coef, f, strict=True)))


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.choice([0, 1, 4, 8, 16, 32, 48])):
        shape = shape.plus(1, rng.randint(16, 1500))
    if shape.is_empty or rng.random() < 0.4:
        shape = shape.plus(rng.choice([16, 64, 128, 256, 320]), rng.choice([0, 256, 1024, 2000]))
    return shape


def rel_error(model: OnlineStepTimeModel, shapes: list[StepShape], scale: float = 1.0) -> float:
    return max(abs(model.predict(s) - truth(s, scale)) / truth(s, scale) for s in shapes)


def seq(rid: str, n: int, start: int) -> ScheduledSeq:
    return ScheduledSeq(rid, [5] * n, start, [0], True, SamplingParams())


def test_shape_of_a_step_reads_rows_chunks_and_context() -> None:
    sched = SchedulerOutput([seq("a", 1, 40), seq("b", 1, 100), seq("c", 64, 0),
                             seq("d", 32, 128)])
    sh = StepShape.of(sched, block_size=16)
    assert sh == StepShape(decode_rows=2, decode_ctx=112, prefill_tokens=96,
                           prefill_attn=64 * 64 + 32 * 160, prefill_chunks=2,
                           prefill_ctx=64 + 160)
    assert sh.decode_only == StepShape(2, 112)
    assert len(sh.features()) == len(FEATURES)
    assert StepShape().is_empty and OnlineStepTimeModel().predict(StepShape()) == 0.0


def test_cpu_prior_is_the_calibrated_model() -> None:
    from batcher.sim.stepmodel import load_step_model

    fitted = load_step_model(str(ROOT / "workloads" / "step_time_cpu.json"))
    assert fitted.prior() == CPU_PRIOR
    shapes = [random_shape(random.Random(i)) for i in range(20)]
    model = OnlineStepTimeModel(fitted.prior())
    for sh in shapes:
        assert model.predict(sh) == pytest.approx(fitted.shape_seconds(sh), rel=1e-9)


def test_prior_rejects_bad_coefficients() -> None:
    with pytest.raises(ValueError):
        StepTimePrior(0.01, (1.0, 2.0))
    with pytest.raises(ValueError):
        StepTimePrior(0.01, (1e-4, -1e-3, 0.0, 0.0, 0.0, 0.0))


def test_learns_a_different_machine_from_measured_steps() -> None:
    rng = random.Random(1)
    model = OnlineStepTimeModel()
    held_out = [random_shape(random.Random(1000 + i)) for i in range(40)]
    assert rel_error(model, held_out) > 1.0  # the CPU prior is far from this device
    for _ in range(300):
        sh = random_shape(rng)
        model.observe(sh, truth(sh) * rng.uniform(0.95, 1.05))
    assert model.num_observations == 300
    assert rel_error(model, held_out) < 0.15


def test_follows_a_slowdown_within_a_few_seconds_of_steps() -> None:
    """A neighbour takes half the machine mid-run: every cost doubles. Within about two
    seconds of 8-stream decode steps the model predicts the new times, prefill included, though
    no prefill ran after the change."""
    rng = random.Random(2)
    model = OnlineStepTimeModel()
    for _ in range(300):
        sh = random_shape(rng)
        model.observe(sh, truth(sh) * rng.uniform(0.95, 1.05))
    decode = StepShape(8, 512)
    mixed = decode.plus(128, 1024)
    assert model.predict(decode) == pytest.approx(truth(decode), rel=0.1)
    elapsed = steps = 0.0
    while elapsed < 2.0:
        t = truth(decode, 2.0) * rng.uniform(0.95, 1.05)
        model.observe(decode, t)
        elapsed += t
        steps += 1
    assert steps > 20
    assert model.predict(decode) == pytest.approx(truth(decode, 2.0), rel=0.1)
    assert model.predict(mixed) == pytest.approx(truth(mixed, 2.0), rel=0.2)
    # ...and back, with the mixed step seen again.
    for _ in range(60):
        for sh in (decode, mixed):
            model.observe(sh, truth(sh) * rng.uniform(0.95, 1.05))
    assert model.predict(mixed) == pytest.approx(truth(mixed), rel=0.1)


def test_one_stalled_step_barely_moves_the_fit() -> None:
    rng = random.Random(3)
    model = OnlineStepTimeModel()
    for _ in range(200):
        sh = random_shape(rng)
        model.observe(sh, truth(sh) * rng.uniform(0.95, 1.05))
    decode = StepShape(8, 512)
    before = model.predict(decode)
    model.observe(decode, 10 * truth(decode))  # the OS took the cores for one step
    assert model.predict(decode) < 1.5 * before
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(decode, bad)
    model.observe(StepShape(), 1.0)
    assert model.num_observations == 201


def test_max_prefill_tokens_is_the_largest_chunk_within_the_target() -> None:
    model = OnlineStepTimeModel()
    steady = model.predict(StepShape(8, 320))
    target = 1.5 * steady
    previous = None
    for ctx in (0, 512, 1024, 2048):
        n = model.max_prefill_tokens(target, 8, 320, ctx)
        assert n > 0
        assert model.predict(StepShape(8, 320).plus(n, ctx)) <= target
        assert model.predict(StepShape(8, 320).plus(n + 1, ctx)) > target
        if previous is not None:
            assert n < previous  # a chunk costs more the longer its context
        previous = n
    assert model.max_prefill_tokens(steady * 0.9, 8, 320, 0) == 0
    assert model.max_prefill_tokens(10.0, 8, 320, 0, limit=300) == 300
    assert model.max_prefill_tokens(10.0, 0, 0, 0, limit=0) == 0


def test_steady_decode_time_stays_anchored_while_a_long_prompt_is_read() -> None:
    """A machine 5x slower than the prior, where prefill is a further 2x dearer. Mixed steps
    with the same decodes and similar chunks cannot separate the decodes' share from the
    chunk's (a fit over every step puts the decode-only step ~2x off here); the decode-only
    prediction, the chunk budget's reference, must stay what decode-only steps measured."""
    prior = OnlineStepTimeModel()

    def slow(shape: StepShape) -> float:
        decode_part = prior.predict(shape.decode_only)
        return 5 * (decode_part + 2 * (prior.predict(shape) - decode_part))

    rng = random.Random(4)
    model = OnlineStepTimeModel()
    decode = StepShape(8, 480)
    for _ in range(30):
        model.observe(decode, slow(decode) * rng.uniform(0.95, 1.05))
    for i in range(120):
        mixed = decode.plus(24, 1000 + 16 * i)
        model.observe(mixed, slow(mixed) * rng.uniform(0.95, 1.05))
    assert model.predict(decode) == pytest.approx(slow(decode), rel=0.1)
    nxt = decode.plus(24, 1000 + 16 * 120)
    assert model.predict(nxt) == pytest.approx(slow(nxt), rel=0.1)


def test_a_few_small_steps_on_a_slower_machine_extrapolate_to_a_large_batch() -> None:
    """A burst of arrivals on a machine 5x slower than the prior: the model has seen three
    one-row decode steps, one prompt-only step and a growing batch of mixed steps, and must
    predict the 16-row decode step the batch is heading for (the chunk budget's reference)."""
    prior = OnlineStepTimeModel()

    def slow(shape: StepShape) -> float:
        return 5 * prior.predict(shape)

    rng = random.Random(5)
    model = OnlineStepTimeModel()
    for _ in range(3):
        model.observe(StepShape(1, 16), slow(StepShape(1, 16)) * rng.uniform(0.95, 1.05))
    model.observe(StepShape().plus(320, 0), slow(StepShape().plus(320, 0)))
    for i in range(40):
        mixed = StepShape(2 + i // 8, 256).plus(16, 16 * i)
        model.observe(mixed, slow(mixed) * rng.uniform(0.95, 1.05))
    batch = StepShape(16, 256)
    assert model.predict(batch) == pytest.approx(slow(batch), rel=0.15)


def test_shape_of_a_step_sums_its_rows_as_plus_does() -> None:
    rng = random.Random(0)
    for _ in range(500):
        seqs = [ScheduledSeq(f"s{i}", [1] * rng.choice([0, 1, 1, 2, 17, 64]),
                             rng.randrange(0, 3000), [0], True, SamplingParams())
                for i in range(rng.randrange(0, 9))]
        want = StepShape()
        for s in seqs:
            want = want.plus(len(s.token_ids), s.start_pos, 16)
        assert StepShape.of(SchedulerOutput(seqs), 16) == want
