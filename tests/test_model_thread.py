"""The model's worker thread: a step's result reaches the event loop's future, and so does its
exception; a future the loop gave up on, or a loop that closed, is left alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batcher.engine.model_thread import ModelThread


async def test_a_result_and_an_exception_reach_the_loop_from_the_thread() -> None:
    thread = ModelThread("test-model")
    loop = asyncio.get_running_loop()
    try:
        names = await asyncio.gather(*(thread.run(loop, lambda: threading.current_thread().name)
                                       for _ in range(3)))
        assert names == ["test-model"] * 3

        def fail() -> None:
            raise RuntimeError("the device is gone")

        with pytest.raises(RuntimeError, match="the device is gone"):
            await thread.run(loop, fail)
        assert await thread.run(loop, lambda a, b: a + b, 2, 3) == 5  # the thread lives on
    finally:
        thread.shutdown()


async def test_a_cancelled_future_is_not_set_and_the_loop_goes_on() -> None:
    thread = ModelThread("test-model")
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    release = threading.Event()
    try:
        fut = thread.run(loop, release.wait, 5.0)
        fut.cancel()
        release.set()
        assert await thread.run(loop, lambda: "next") == "next"  # after the cancelled one
        assert fut.cancelled() and errors == []
    finally:
        thread.shutdown()


def test_a_closed_loop_gets_no_call_and_the_thread_goes_on() -> None:
    thread = ModelThread("test-model")
    loop = asyncio.new_event_loop()
    done = threading.Event()

    def slow() -> str:
        time.sleep(0.05)
        return "late"

    try:
        thread.run(loop, slow)
        loop.close()  # before the step ends: nobody waits for it
        thread.submit(done.set)
        assert done.wait(5.0)  # the thread took its next job
    finally:
        thread.shutdown()
