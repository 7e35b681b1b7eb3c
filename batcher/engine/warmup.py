"""Warm start: run the warm-up and calibration plans (`batcher.core.calibration`) through the engine
before the server reports ready.

The requests are the engine's own (tenant `__warmup__`, prompts of distinct token ids so no prefix
cache hit shortens them, EOS ignored so every shape runs as planned); they never reach admission,
the SLO controller or the request metrics. During warm-up (`engine.phase == "warm"`) steps teach
nothing; during calibration they feed the step-time model and the step listeners (admission's
prefill rates) as served steps do.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from batcher.core.calibration import (
    FIRST_PROMPT_ID,
    Plan,
    Wave,
    calibration_plan,
    synthetic_prompt,
    warmup_plan,
)
from batcher.core.step_time import StepShape
from batcher.engine.engine import AsyncEngine
from batcher.engine.events import EngineError
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams

log = logging.getLogger(__name__)

TENANT = "__warmup__"
# A warm start that takes longer than this has a model that cannot serve: stop the start.
DEFAULT_TIMEOUT_S = 900.0
# Each phase starts no new wave after this many seconds: on a machine slowed by its neighbours
# (or a model far too big for it) the start stays bounded. The waves run in order of need: every
# prompt length and batch size before the sampling paths and mixed steps; calibration's prefill
# and decode steps before its mixed ones.
WARM_BUDGET_S = 60.0
CALIBRATE_BUDGET_S = 20.0
LIGHT_CALIBRATE_BUDGET_S = 3.0


@dataclass(slots=True)
class WarmStart:
    """What a warm start did and measured (logged at start-up; `/admin/config` shows it)."""

    warmup_s: float = 0.0
    calibrate_s: float = 0.0
    warmup_steps: int = 0
    calibrate_steps: int = 0
    # Waves left out when a phase ran past its budget (a slow machine).
    waves_skipped: int = 0
    requests: int = 0
    compilations_during: int = 0
    # Calibrated step times (ms) the server starts with: decode-only by batch size, and a
    # prefill-only step by chunk size.
    decode_ms: dict[int, float] = field(default_factory=dict)
    prefill_ms: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"warmup_s": round(self.warmup_s, 3), "calibrate_s": round(self.calibrate_s, 3),
                "warmup_steps": self.warmup_steps, "calibrate_steps": self.calibrate_steps,
                "waves_skipped": self.waves_skipped,
                "requests": self.requests, "compilations_during": self.compilations_during,
                "decode_ms": {str(k): round(v, 3) for k, v in self.decode_ms.items()},
                "prefill_ms": {str(k): round(v, 3) for k, v in self.prefill_ms.items()}}


def _sampling(path: str, max_tokens: int, grammar: str | None) -> SamplingParams:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if path == "random":
        sp.temperature, sp.top_p, sp.top_k, sp.seed = 0.8, 0.9, 20, 7
    elif path == "penalties":
        sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty = 0.5, 0.5, 1.1
    elif path == "logprobs":
        sp.logprobs = 5
    elif path == "bias":
        sp.logit_bias, sp.min_p, sp.temperature = {FIRST_PROMPT_ID: 1.0}, 0.05, 0.7
    elif path == "grammar":
        sp.grammar = grammar
    return sp


class _Driver:
    """Runs plans through one engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.vocab = int(getattr(engine.tokenizer, "vocab_size", 0) or 0)
        self.ids = itertools.count()
        self.count = itertools.count()
        self.grammar = _grammar(engine)

    def prompt(self, n: int) -> list[int]:
        return synthetic_prompt(self.ids, n, self.vocab)

    async def one(self, prompt: int, sampling: SamplingParams,
                  first: asyncio.Event | None) -> None:
        req = Request(f"{TENANT}-{next(self.count)}", self.prompt(prompt), sampling,
                      tenant=TENANT)
        async for ev in self.engine.generate(req):
            if ev.finish_reason == "error":
                raise EngineError(ev.error or "a warm-up request failed")
            if ev.token_ids and first is not None:
                first.set()

    async def wave(self, wave: Wave) -> None:
        paths = itertools.cycle(wave.sampling)
        firsts: list[asyncio.Event] = []
        tasks = []
        for g in wave.first:
            for _ in range(g.count):
                path = next(paths)
                if path == "grammar" and self.grammar is None:
                    path = "greedy"
                ev = asyncio.Event()
                firsts.append(ev)
                tasks.append(asyncio.ensure_future(
                    self.one(g.prompt_tokens, _sampling(path, g.max_tokens, self.grammar), ev)))
        try:
            if wave.late:
                waiter = asyncio.ensure_future(_all_set(firsts))
                pending: set[asyncio.Future] = {waiter, *tasks}
                try:
                    while not waiter.done():
                        done, pending = await asyncio.wait(
                            pending, return_when=asyncio.FIRST_COMPLETED)
                        for t in done:  # a first request that failed ends the wave
                            if t is not waiter and t.exception() is not None:
                                raise t.exception()  # type: ignore[misc]
                finally:
                    waiter.cancel()
                for g in wave.late:
                    for _ in range(g.count):
                        tasks.append(asyncio.ensure_future(self.one(
                            g.prompt_tokens, _sampling("greedy", g.max_tokens, None), None)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def run(self, plan: Plan, budget_s: float = float("inf")) -> int:
        """Run the waves in order until `budget_s` is spent; returns the waves left undone."""
        deadline = time.perf_counter() + budget_s
        refit = self.engine.phase == "calibrate"
        for i, wave in enumerate(plan.waves):
            if time.perf_counter() > deadline:
                return len(plan.waves) - i
            if refit and wave.late:
                # NOTE: before the mixed steps, the step-time model is refitted to the steps
                # measured so far: admission compares each step's wall time with the model's
                # price of it, and a price from the prior would skew those ratios for good.
                self.engine.step_time_model.refit_recorded(keep=True)
                refit = False
            await self.wave(wave)
        return 0


async def _all_set(events: list[asyncio.Event]) -> None:
    for e in events:
        await e.wait()


def _grammar(engine: AsyncEngine) -> str | None:
    if not engine.supports_grammar:
        return None
    try:
        from batcher.structured.grammars import json_schema_grammar

        return json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}},
                                   "warm-up")
    except Exception:  # no grammar engine installed: the path cannot be used by clients either
        return None


def _calibrated(engine: AsyncEngine, report: WarmStart) -> None:
    model, bs = engine.step_time_model, engine.kv.block_size
    for rows in (1, 8, 32, 64, 128, 256):
        if rows <= engine.scheduler.config.max_num_seqs:
            report.decode_ms[rows] = 1000 * model.predict(StepShape(rows, 4 * bs))
    budget = engine.scheduler.config.max_num_batched_tokens
    for tokens in sorted({64, 256, budget}):
        if tokens <= budget:
            report.prefill_ms[tokens] = 1000 * model.predict(StepShape().plus(tokens, 0, bs))


async def warm_start(engine: AsyncEngine, timeout_s: float = DEFAULT_TIMEOUT_S,
                     calibrate: bool = True, warm_budget_s: float = WARM_BUDGET_S,
                     calibrate_budget_s: float = CALIBRATE_BUDGET_S) -> WarmStart:
    """Warm every shape, then calibrate on this device; leaves the engine serving."""
    from batcher.runtime.compile_count import compilations

    cfg = engine.scheduler.config
    tokens_free = engine.kv.num_free_blocks * engine.kv.block_size
    report = WarmStart()
    driver = _Driver(engine)
    sampling = ("greedy", "random", "penalties", "logprobs", "bias")
    if driver.grammar is not None:
        sampling += ("grammar",)
    before = compilations()
    start_steps = engine.steps
    # Read once now, not on the first request (the whole vocabulary is scanned).
    getattr(engine.tokenizer, "max_chars_per_token", None)
    t0 = time.perf_counter()
    kind = getattr(engine.runner, "warm_up_kind", "full")
    try:
        async with asyncio.timeout(timeout_s):
            engine.phase = "warm"
            # "full": kernels compile or graphs capture per shape (CUDA, torch.compile); "light":
            # eager steps (a CPU); "none": nothing runs a model (the fake one).
            if kind != "none":
                report.waves_skipped += await driver.run(
                    warmup_plan(cfg, cfg.max_model_len, tokens_free, sampling,
                                light=kind == "light"), warm_budget_s)
            if kind != "full":
                # Eager steps: the prior was measured on such a machine; a short calibration
                # rescales it, and a start that many tests and replicas pay stays short.
                calibrate_budget_s = min(calibrate_budget_s, LIGHT_CALIBRATE_BUDGET_S)
            report.warmup_s = time.perf_counter() - t0
            report.warmup_steps = engine.steps - start_steps
            if calibrate:
                engine.phase = "calibrate"
                t1, s1 = time.perf_counter(), engine.steps
                engine.step_time_model.start_recording()
                report.waves_skipped += await driver.run(
                    calibration_plan(cfg, cfg.max_model_len, tokens_free, exact=kind == "none"),
                    calibrate_budget_s)
                engine.step_time_model.refit_recorded()
                report.calibrate_s = time.perf_counter() - t1
                report.calibrate_steps = engine.steps - s1
    finally:
        engine.phase = "serve"
    report.requests = next(driver.count)
    report.compilations_during = compilations() - before
    _calibrated(engine, report)
    if report.waves_skipped and kind == "full":
        log.warning("warm start: %d waves left out past the time budget (a slow or busy "
                    "machine): the first requests may pay for what they would have warmed",
                    report.waves_skipped)
    log.info("warm start: warm-up %.2fs (%d steps, %d compilations), calibration %.2fs "
             "(%d steps, %d waves left out past the budget); decode step ms by batch %s; "
             "prefill step ms by tokens %s",
             report.warmup_s, report.warmup_steps, report.compilations_during,
             report.calibrate_s, report.calibrate_steps, report.waves_skipped,
             {k: round(v, 2) for k, v in report.decode_ms.items()},
             {k: round(v, 2) for k, v in report.prefill_ms.items()})
    return report
