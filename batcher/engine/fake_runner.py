"""`--model fake`: a deterministic runner behind the real engine, scheduler and block pool.

Only the model step is simulated: it sleeps for a time given by prefill and decode rates and
returns tokens that depend only on (last token, position), so a request re-prefilled elsewhere
(failover `resume`) continues with the same tokens. A step-time factor makes one replica of a
fleet slower than the others. Fault switches let fleet tests make a replica hang, crash, slow
down or fail. Many such replicas fit on two cores.

Every cost may be zero (`--fake-decode-step-ms 0 --fake-per-seq-ms 0 --fake-prefill-rate inf`):
a model that costs nothing, so what remains of a step is the host's own work (scheduling,
detokenizing, streaming), the ceiling of every figure a real device can reach behind this
server. The fake model stands for a device, so unset it takes the CUDA defaults of sequences and
tokens per step, not the CPU ones fitted to the bundled model's cost per row."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from batcher.core.outputs import RunnerOutput, SchedulerOutput, fill_pending_inputs
from batcher.core.spec_verify import run_by_rule
from batcher.engine.warmup import TENANT as WARM_START_TENANT

FAULTS = ("none", "hang", "crash", "slow", "error")
WARM_START_IDS = WARM_START_TENANT + "-"  # the warm start's request ids
_FIRST_TOKEN = 300  # skip special and byte tokens so the text is plain
# KV blocks without --num-blocks: a full batch of the CUDA default sequences (256) at 1,024 tokens
# each, in blocks of 16, so the fake runs all of them at once as a device would.
FAKE_NUM_BLOCKS = 16384


@dataclass(slots=True)
class FakeSpeed:
    prefill_tokens_per_s: float = 20_000.0  # math.inf: prompts cost nothing
    decode_step_s: float = 0.02  # one step with any number of decodes (memory-bound)
    per_seq_s: float = 0.0002  # extra per decoding sequence
    step_factor: float = 1.0  # every step this many times as long (a slower machine)


@dataclass(slots=True)
class FakeDevice:
    """The `--fake-*` flags: how fast the simulated device is, and which fault it injects."""

    speed: FakeSpeed
    fault: str = "none"  # one of FAULTS
    fault_after_steps: int = 0
    # The device queues steps as a GPU's stream does (`QueuedFakeRunner`): benches of the
    # host's side; off, each step runs to its end on the model thread.
    queued: bool = False


class FakeRunner:
    """Implements the engine's Runner protocol without a model."""

    warm_up_kind = "none"  # nothing to compile: a warm start only calibrates

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int,
                 speed: FakeSpeed | None = None, fault: str = "none", fault_after_steps: int = 0):
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}")
        if speed is not None and not speed.step_factor > 0:
            raise ValueError("the fake model's step factor must be > 0")
        if speed is not None and (speed.decode_step_s < 0 or speed.per_seq_s < 0
                                  or not speed.prefill_tokens_per_s > 0):
            raise ValueError("the fake model's step costs must be >= 0 and its prefill "
                             "rate > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.speed = speed or FakeSpeed()
        self.fault = fault
        self.fault_after_steps = fault_after_steps
        self.steps = 0
        self.served_steps = 0  # steps with a request besides the warm start's: faults count these
        self._hang = threading.Event()

    def next_token(self, last_token: int, position: int) -> int:
        span = self.vocab_size - _FIRST_TOKEN - 1
        return _FIRST_TOKEN + (last_token * 7919 + position * 104729) % span

    def step_seconds(self, sched: SchedulerOutput) -> float:
        sp = self.speed
        prefill = sum(s.num_tokens for s in sched.seqs[sched.num_decodes:])
        decodes = sched.num_decodes
        return sp.step_factor * (sp.decode_step_s + decodes * sp.per_seq_s
                                 + prefill / sp.prefill_tokens_per_s)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out, seconds = self._step(sched)
        if seconds > 0:
            time.sleep(seconds)
        return out

    def _step(self, sched: SchedulerOutput) -> tuple[RunnerOutput, float]:
        """The step's tokens and how long the device takes for it (faults applied)."""
        self.steps += 1
        # NOTE: a fault strikes after N steps of traffic: the warm start's calibration steps,
        # before the server is ready, are not the steps a test or a study counts.
        if not all(s.request_id.startswith(WARM_START_IDS) for s in sched.seqs):
            self.served_steps += 1
        seconds = self.step_seconds(sched)
        if self.fault != "none" and self.served_steps > self.fault_after_steps:
            if self.fault == "hang":
                self._hang.wait()  # never set: a wedged engine
            elif self.fault == "crash":
                os._exit(70)
            elif self.fault == "slow":
                seconds *= 20
            elif self.fault == "error":
                raise RuntimeError("injected model fault")
        seqs = sched.seqs
        if any(s.draft_token_ids for s in seqs):
            return run_by_rule(seqs, self.next_token), seconds
        # NOTE: what run_by_rule gives without drafts, in one pass: a model that costs nothing
        # should cost its host little more (no logprobs: the engine reads none as None).
        span = self.vocab_size - _FIRST_TOKEN - 1
        ids = [s.request_id for s in seqs if s.sample]
        tokens = [_FIRST_TOKEN + (s.token_ids[-1] * 7919
                                  + (s.start_pos + len(s.token_ids) - 1) * 104729) % span
                  for s in seqs if s.sample]
        return RunnerOutput(ids, tokens), seconds


class QueuedFakeRunner(FakeRunner):
    """The fake device as a GPU's stream: `launch` queues a step behind the steps already
    queued and returns at once; `finish` waits until the device has run it. So the engine's
    model thread launches the next step while the device still runs this one, as with the real
    runner on CUDA (`ModelRunner.launch`). A step scheduled ahead takes its inputs at launch
    (the fake's tokens are known then; the real runner's are taken on the device). Faults
    strike at launch, which may be a step before the one the reader is waiting for; `hang`
    wedges the model thread."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._busy_until = 0.0  # when the device has run every step queued so far

    def launch(self, sched: SchedulerOutput, before: tuple[RunnerOutput, float] | None = None
               ) -> tuple[RunnerOutput, float]:
        """(the step's output, when the device will have run it)."""
        fill_pending_inputs(sched, None if before is None else before[0])
        if sched.is_empty:
            return RunnerOutput(), 0.0
        out, seconds = self._step(sched)
        self._busy_until = max(time.monotonic(), self._busy_until) + seconds
        return out, self._busy_until

    @staticmethod
    def finish(launched: tuple[RunnerOutput, float]) -> RunnerOutput:
        out, done_at = launched
        wait = done_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return out

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.finish(self.launch(sched))


def build_fake_engine(device: FakeDevice, sched, cache, metrics, version, overlap: bool = True):
    """The real AsyncEngine over a FakeRunner (`--model fake`), with the scheduler and cache
    settings given (`batcher.core.config`); `batcher.engine.factory` builds it."""
    from batcher.engine.detokenizer import byte_level_table
    from batcher.engine.engine import AsyncEngine
    from batcher.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer()
    byte_level_table(tok)  # built now, not on the first request (tens of ms)
    kind = QueuedFakeRunner if device.queued else FakeRunner
    runner = kind(cache.num_blocks or FAKE_NUM_BLOCKS, cache.block_size, tok.vocab_size,
                  device.speed, device.fault, device.fault_after_steps)
    return AsyncEngine(runner, tok, sched.validate(), cache.enable_prefix_caching,
                       prefix_cache_scope=cache.prefix_cache_scope,
                       metrics=metrics, version=version, overlap=overlap)
