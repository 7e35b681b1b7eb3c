"""`--model fake`: its costs, a model that costs nothing, and the defaults it takes."""

from __future__ import annotations

import argparse
import math

import pytest

from batcher.core.config import CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS
from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.engine.factory import build_engine
from batcher.engine.fake_runner import FAKE_NUM_BLOCKS, FakeRunner, FakeSpeed
from batcher.core.sampling import SamplingParams
from batcher.app.serve_flags import add_serve_args, engine_config_from_args, fake_device_from_args


def serve_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["--model", "fake", *flags])


def step(decodes: int, prefill_tokens: int) -> SchedulerOutput:
    seqs = [ScheduledSeq(f"d{i}", [1], 10, [0], True, SamplingParams())
            for i in range(decodes)]
    if prefill_tokens:
        seqs.append(ScheduledSeq("p", list(range(prefill_tokens)), 0, [0] * 8, True,
                                 SamplingParams()))
    return SchedulerOutput(seqs)


def test_every_cost_of_a_step_is_its_own_flag() -> None:
    args = serve_args("--fake-decode-step-ms", "10", "--fake-per-seq-ms", "0.5",
                      "--fake-prefill-rate", "1000")
    assert args.fake_per_seq_ms == 0.5
    sp = FakeSpeed(args.fake_prefill_rate, args.fake_decode_step_ms / 1000,
                   args.fake_per_seq_ms / 1000)
    assert FakeRunner(64, 16, 1000, sp).step_seconds(step(4, 100)) == pytest.approx(
        0.010 + 4 * 0.0005 + 0.1)
    assert serve_args().fake_per_seq_ms == 0.2  # today's cost unless asked otherwise


def test_a_model_that_costs_nothing() -> None:
    args = serve_args("--fake-decode-step-ms", "0", "--fake-per-seq-ms", "0",
                      "--fake-prefill-rate", "inf")
    assert args.fake_prefill_rate == math.inf
    sp = FakeSpeed(args.fake_prefill_rate, 0.0, 0.0)
    runner = FakeRunner(64, 16, 1000, sp)
    assert runner.step_seconds(step(256, 8192)) == 0.0
    out = runner.execute(step(3, 5))  # no sleep, and still the deterministic tokens
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("flags", [("--fake-prefill-rate", "0"),
                                   ("--fake-prefill-rate", "-inf"),
                                   ("--fake-prefill-rate", "nan"),
                                   ("--fake-per-seq-ms", "-1"),
                                   ("--fake-per-seq-ms", "inf")])
def test_costs_that_mean_nothing_are_refused(flags) -> None:
    with pytest.raises(SystemExit):
        serve_args(*flags)


def test_negative_costs_are_refused_in_code_too() -> None:
    with pytest.raises(ValueError, match="step costs"):
        FakeRunner(64, 16, 1000, FakeSpeed(per_seq_s=-1e-3))
    with pytest.raises(ValueError, match="prefill rate"):
        FakeRunner(64, 16, 1000, FakeSpeed(prefill_tokens_per_s=0.0))


def test_the_fake_model_takes_the_device_defaults_unless_told() -> None:
    args = serve_args()
    cache = engine_config_from_args(args).cache_config()
    engine = build_engine("fake", engine_config_from_args(args), fake=fake_device_from_args(args))
    cfg = engine.scheduler.config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (CUDA_MAX_NUM_SEQS,
                                                               CUDA_MAX_NUM_BATCHED_TOKENS)
    assert engine.kv.num_total_blocks == FAKE_NUM_BLOCKS
    assert engine.overlap  # each step launched before the last one is emitted
    # A full batch of 128-token prompts and 256-token answers fits at once.
    assert FAKE_NUM_BLOCKS * cache.block_size >= CUDA_MAX_NUM_SEQS * (128 + 256)
    args = serve_args("--max-num-seqs", "8", "--max-num-batched-tokens", "100",
                      "--num-blocks", "64")
    engine = build_engine("fake", engine_config_from_args(args), fake=fake_device_from_args(args))
    assert (engine.scheduler.config.max_num_seqs,
            engine.scheduler.config.max_num_batched_tokens) == (8, 100)
    assert engine.kv.num_total_blocks == 64
    args = serve_args("--no-step-overlap")
    engine = build_engine("fake", engine_config_from_args(args), fake=fake_device_from_args(args))
    assert not engine.overlap


def test_a_step_without_drafts_gives_what_the_rule_gives() -> None:
    from batcher.core.spec_verify import run_by_rule

    runner = FakeRunner(64, 16, 1000, FakeSpeed(math.inf, 0.0, 0.0))
    sched = step(5, 40)
    sched.seqs[1].sample = False  # a prefill chunk that does not reach its end
    out = runner.execute(sched)
    want = run_by_rule(sched.seqs, runner.next_token)
    assert (out.request_ids, out.token_ids) == (want.request_ids, want.token_ids)
    assert len(out.request_ids) == 5


def test_faults_count_the_steps_of_traffic_not_the_warm_start() -> None:
    from batcher.engine.warmup import TENANT

    runner = FakeRunner(64, 16, 1000, FakeSpeed(math.inf, 0.0, 0.0), fault="error",
                        fault_after_steps=1)
    warm = SchedulerOutput([ScheduledSeq(f"{TENANT}-{i}", [1], 4, [0], True, SamplingParams())
                            for i in range(3)])
    for _ in range(5):
        runner.execute(warm)  # calibration before ready: no fault yet
    runner.execute(step(2, 0))  # the first step of traffic
    with pytest.raises(RuntimeError, match="injected"):
        runner.execute(step(2, 0))
