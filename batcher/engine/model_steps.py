"""The model's side of an engine's steps: each scheduled step run on the model thread, timed
there, its result in a future of the engine's loop.

A runner that splits a step in two (`launch` on the model thread, `finish` where its tokens are
read back: the real one) has its tokens read on a thread of its own, in launch order; so the
model thread launches the next step, with its inputs taken from this one on the device, while
the device still runs this one. A runner with `execute` alone runs each step to its end on the
model thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from batcher.core.outputs import RunnerOutput, SchedulerOutput, fill_pending_inputs
from batcher.engine.model_thread import ModelThread

log = logging.getLogger(__name__)

# What the engine awaits for a step: (its output, the model's seconds for it, when it ended).
StepResult = tuple[RunnerOutput, float, float]


class ModelSteps:
    """Runs steps on the model thread (`run`) for one engine, and lets the loop wait until the
    step it handed over last is under way (`wait_under_way`): queued on the device, by the
    runner's word (`on_launch`), else started."""

    def __init__(self, runner: Any, clock: Callable[[], float]) -> None:
        self.runner = runner
        self.clock = clock
        self._model = ModelThread("batcher-model")
        splits = hasattr(runner, "launch") and hasattr(runner, "finish")
        self._reader = ModelThread("batcher-reader") if splits else None
        # False (set before the engine starts): the model thread runs each step to its end
        # (`execute`) even where the runner can split it, to compare.
        self.read_apart = True
        # Told each step and the model's seconds for it, on the thread that timed it (the model
        # thread, or the reader): a study's own timing of the model, whatever the runner.
        self.on_step: Callable[[SchedulerOutput, float], None] | None = None
        # Steps by their order: handed over (the loop's count), in the model thread's hands,
        # under way and done launching (the model thread's). Whether the model thread had
        # launched every step before the last one handed over, when it was handed over.
        self._handed = self._in_hand = self._under_way = self._launched = 0
        self._found_idle = False
        self._signal = threading.Condition()
        self._observer_faults = 0
        self.runner_signals = hasattr(runner, "on_launch")
        if self.runner_signals:
            runner.on_launch = self.under_way
        # NOTE: only the model thread reads or writes these two, in the order steps run: a step
        # scheduled ahead runs right after the one it follows, and takes its inputs from it.
        self._last_output: RunnerOutput | None = None
        self._last_launched: Any = None  # as `launch` returned it
        self._last_read = float("-inf")  # when the reader last had a step's tokens (its own)

    @property
    def launches_apart(self) -> bool:
        """Steps are launched on the model thread and read back on the reader: the model thread
        is free for the next step as soon as this one is queued on the device."""
        return self._reader is not None and self.read_apart

    def run(self, loop: asyncio.AbstractEventLoop, sched: SchedulerOutput
            ) -> asyncio.Future[StepResult]:
        """Queue `sched` on the model thread, behind any step handed over before it."""
        idle = self._launched == self._handed
        if not self.launches_apart:
            fut = self._model.run(loop, self._timed_execute, sched)
        else:
            fut = self._model.run(loop, self._timed_launch, sched,
                                  then=(self._reader, self._timed_finish))
        self._handed += 1
        self._found_idle = idle
        return fut

    def wait_under_way(self, timeout: float) -> None:
        """Wait, at most `timeout` s, until the step handed over last is under way, if the
        model thread had nothing else in hand when it was handed over: the model thread needs
        the GIL to launch it, and a loop that goes on in Python would hold it for a switch
        interval. A model thread still busy with the step before (running it to its end, or a
        launch that waits for the device) is not waited for."""
        if not self._found_idle:
            return
        n = self._handed
        with self._signal:
            self._signal.wait_for(lambda: self._under_way >= n, timeout)

    def under_way(self) -> None:
        """The step in the model thread's hands is under way (the runner's `on_launch`, called
        on the model thread, inside the step's launch)."""
        with self._signal:
            self._under_way = self._in_hand
            self._signal.notify_all()

    def _take(self) -> None:
        """On the model thread, as a step starts."""
        self._in_hand += 1
        if not self.runner_signals:
            self.under_way()

    def _taken(self) -> None:
        """On the model thread, as a step's launch (or the whole step) returns or fails."""
        self._launched = self._in_hand
        if self._under_way != self._in_hand:
            self.under_way()

    def shutdown(self) -> None:
        """Run nothing more: steps not yet started are cancelled."""
        self._model.shutdown(wait=False, cancel_futures=True)
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    async def join(self, timeout: float) -> None:
        """Wait (off the loop) up to `timeout` s a thread for the threads to end."""
        loop = asyncio.get_running_loop()
        for thread in (self._model, self._reader):
            if thread is not None:
                await loop.run_in_executor(None, thread.join, timeout)

    def _timed_execute(self, sched: SchedulerOutput) -> StepResult:
        """Run a step on the model thread and time it there: the model's own time, without the
        event loop's delay in noticing that it finished, and when it finished."""
        self._take()
        started = self.clock()
        before, self._last_output = self._last_output, None
        try:
            fill_pending_inputs(sched, before)
            out = self.runner.execute(sched)
        finally:
            self._taken()
        self._last_output = out
        ended = self.clock()
        self._tell(sched, ended - started)
        return out, ended - started, ended

    def _timed_launch(self, sched: SchedulerOutput) -> tuple[Any, float, SchedulerOutput]:
        """Launch a step on the model thread: (what `launch` returned, when it started, the
        step). A step
        scheduled ahead takes its inputs from the step launched just before it, on the device
        where the runner can (`batcher.runtime.launched_step`)."""
        self._take()
        started = self.clock()
        before, self._last_launched = self._last_launched, None
        try:
            launched = self.runner.launch(sched, before if sched.inputs_pending else None)
        finally:
            self._taken()
        self._last_launched = launched
        return launched, started, sched

    def _timed_finish(self, launched: tuple[Any, float, SchedulerOutput]) -> StepResult:
        """On the reader thread: a launched step's output once its tokens are on the host, its
        model seconds (from its launch, or from the end of the step before it when it was
        launched behind that one: the device runs steps in turn) and when it ended."""
        step, started, sched = launched
        out = self.runner.finish(step)
        ended = self.clock()
        seconds = ended - max(started, self._last_read)
        self._last_read = ended
        self._tell(sched, seconds)
        return out, seconds, ended

    def _tell(self, sched: SchedulerOutput, seconds: float) -> None:
        """`on_step`, if set; a fault there is logged, never the step's."""
        if self.on_step is not None:
            try:
                self.on_step(sched, seconds)
            except Exception:  # noqa: BLE001 (an observer's bug must not fail serving)
                self._observer_faults += 1
                if self._observer_faults & (self._observer_faults - 1) == 0:  # 1, 2, 4, 8...
                    log.exception("a step observer failed (%d times)", self._observer_faults)
