"""The one worker thread that runs an engine's model steps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class ModelThread(Executor):
    """One daemon worker thread for model steps.

    Not a ThreadPoolExecutor: its workers are joined at interpreter exit, so a model call that
    never returns (a wedged device or driver) would keep a stopped server alive forever. A daemon
    thread is abandoned at exit instead.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False
        # Another thread may submit (the model thread hands steps to the reader) while this one
        # is shut down: a job is queued before the stop marker or refused, never left behind it.
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the model thread is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._jobs.put((fut, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return fut

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], /, *args: Any,
            then: tuple[ModelThread, Callable[[Any], Any]] | None = None
            ) -> asyncio.Future[Any]:
        """`fn(*args)` on the thread, its result (or exception) in a future of `loop`; with
        `then=(other, finish)`, the future's result is `finish(fn(*args))`, run on `other`
        (in the order of this thread's calls), and this thread goes on meanwhile.

        `loop.run_in_executor` passes a result through a concurrent Future, its lock and its
        callbacks, before the loop wakes; here the thread sets the loop's future with one call
        into the loop, which wakes it sooner (every step waits for this wake-up). A future the
        loop cancelled meanwhile is left as it is; a closed loop is told nothing."""
        fut = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.cancelled():
                fut.set_result(value) if ok else fut.set_exception(value)

        def tell(ok: bool, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, ok, value)

        def job() -> None:
            ok, value = _call(fn, *args)
            if ok and then is not None:
                other, finish = then
                try:
                    other.submit(lambda: tell(*_call(finish, value)))
                    return
                except RuntimeError as exc:  # the other thread is shut down
                    ok, value = False, exc
            tell(ok, value)

        self.submit(job)
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 (handed to the awaiting step loop)
                fut.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
        if cancel_futures:
            with contextlib.suppress(queue.Empty):
                while (job := self._jobs.get_nowait()) is not None:
                    job[0].cancel()
        self._jobs.put(None)
        if wait and self._thread is not None:
            self._thread.join()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the thread to end; whether it did. A process that exits
        while this thread is still inside torch aborts ("terminate called ...")."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


def _call(fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """(True, `fn(*args)`), or (False, the exception it raised)."""
    try:
        return True, fn(*args)
    except BaseException as exc:  # noqa: BLE001 (handed to the awaiting loop)
        return False, exc
