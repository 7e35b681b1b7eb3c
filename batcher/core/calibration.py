"""What a server runs before it reports ready: the warm-up and calibration plans.

Warm-up runs every shape the server will use once (prefill chunks of several lengths, decode
batches of several sizes, a mixed step, every sampling path), so that kernels compile, graphs
capture and lazy tables fill before the first client request, not inside it. Nothing it measures
is kept: a first run's time is the compiler's, not the device's.

Calibration then runs a few more steps of known shapes and lets the engine learn from them as from
any step: prefill-only steps at a few chunk sizes, decode-only steps at a few batch sizes, and
mixed steps (a prompt read beside running streams). The step-time model and the TTFT predictor
start from the device the server runs on instead of a prior measured elsewhere, so the first burst
is admitted by what this device does.

A plan is a list of waves. Each wave's `first` requests start together; its `late` requests start
once every one of the first has its first token (so they are read beside streams that decode).
Pure Python: the engine (`batcher.engine.warmup`) and the simulator drive the same plans.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from batcher.core.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class Group:
    """`count` requests of `prompt_tokens` each, generating `max_tokens` each."""

    count: int
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Wave:
    first: tuple[Group, ...]
    late: tuple[Group, ...] = ()
    # The sampling paths to exercise (warm-up only): names of `SAMPLING_PATHS`.
    sampling: tuple[str, ...] = ("greedy",)

    @property
    def requests(self) -> int:
        return sum(g.count for g in (*self.first, *self.late))


# Synthetic prompts' token ids start here (past the special and byte tokens of common
# vocabularies) and step through the vocabulary, so no prompt of a warm start repeats another's
# blocks (a prefix-cache hit would shorten the step it is meant to measure).
FIRST_PROMPT_ID = 1000


def synthetic_prompt(counter: Iterator[int], n: int, vocab_size: int) -> list[int]:
    """`n` token ids for a warm-start prompt, drawn from `counter` (shared by a plan's prompts)."""
    span = max(1, vocab_size - FIRST_PROMPT_ID - 1)
    return [FIRST_PROMPT_ID + next(counter) % span for _ in range(n)]


# The longest prefill chunk calibration measures (see `calibration_plan`).
CALIBRATE_MAX_CHUNK = 2048

# Sampling variants whose code paths differ (greedy argmax, the filtered sampler, penalties over
# the history, logprobs, logit bias); warm-up runs each once.
SAMPLING_PATHS = ("greedy", "random", "penalties", "logprobs", "bias")


@dataclass(frozen=True, slots=True)
class Plan:
    waves: tuple[Wave, ...] = field(default_factory=tuple)

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.waves)


def _ladder(top: int, steps: tuple[int, ...]) -> list[int]:
    """`steps` capped at `top`, with `top` itself, ascending, no repeats."""
    return sorted({min(top, s) for s in steps} | {top})


def _limits(config: SchedulerConfig, max_len: int, tokens_free: int) -> tuple[int, int]:
    """The longest chunk and the largest decode batch a plan may use: the step's token budget
    and `max_num_seqs`, within the context and the KV pool (a batch of `b` rows holds b x
    (prompt + output) tokens)."""
    budget = max(2, min(config.max_num_batched_tokens, max_len - 2, tokens_free // 2))
    return budget, max(1, min(config.max_num_seqs, tokens_free // 48))


def warmup_plan(config: SchedulerConfig, max_len: int, tokens_free: int,
                sampling: tuple[str, ...] = SAMPLING_PATHS, light: bool = False) -> Plan:
    """Prompts of several lengths (multiples of the kernels' tile sizes and not), decode batches
    of several sizes, each sampling path once, and one mixed step. `light`: for a device with
    nothing to compile or capture (eager steps on a CPU), one prompt, one batch and the sampling
    paths, which fill what is built on first use."""
    budget, most = _limits(config, max_len, tokens_free)
    if light:
        return Plan((Wave((Group(1, budget, 2),)), Wave((Group(min(8, most), 8, 3),)),
                     Wave((Group(len(sampling), 8, 3),), sampling=sampling)))
    prompts = [p for p in _ladder(budget, (7, 64, 1024)) if p >= 2]
    batches = _ladder(most, (1, 3, 8, 32, 128))
    waves = [Wave((Group(1, p, 2),)) for p in prompts]
    waves += [Wave((Group(b, 8, 3),)) for b in batches]
    waves.append(Wave((Group(len(sampling), 8, 3),), sampling=sampling))
    waves.append(Wave((Group(min(8, most), 8, 6),), (Group(1, prompts[-1], 1),)))
    return Plan(tuple(waves))


def calibration_plan(config: SchedulerConfig, max_len: int, tokens_free: int,
                     exact: bool = False) -> Plan:
    """Measured steps of every kind, as few as fit a linear step model: prefill alone at three
    chunk sizes, decode batches of three sizes for a few steps each, and a prompt read beside a
    small and a full batch of streams. `exact`: a device whose steps cost the same every time
    (a simulated one) needs no repeats to average: two decode steps a batch, and streams that
    decode just long enough for the prompt to be read beside them."""
    budget, most = _limits(config, max_len, tokens_free)
    # NOTE: chunks past CALIBRATE_MAX_CHUNK add cost, not information: the model is linear in
    # the chunk's tokens and its attention, and extrapolates to the budget.
    prompts = [p for p in _ladder(min(budget, CALIBRATE_MAX_CHUNK), (64, 512)) if p >= 2]
    batches = _ladder(most, (1, 16))
    decode_tokens, beside_tokens = (3, 4) if exact else (6, 10)
    waves = [Wave((Group(1, p, 1),)) for p in prompts]
    waves += [Wave((Group(b, 8, decode_tokens),)) for b in batches]
    for b in sorted({min(8, most), most}):
        waves.append(Wave((Group(b, 8, beside_tokens),), (Group(1, prompts[-1], 1),)))
    return Plan(tuple(waves))
