"""The engine inside your own program, without HTTP.

    from batcher import LLM, EngineConfig, SamplingParams

    with LLM("smollm2-135m", EngineConfig(max_num_seqs=8)) as llm:
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=8)).text)

    async with AsyncLLM("smollm2-135m") as llm:          # in an asyncio program
        result = await llm.generate("Hello")
        async for delta in llm.stream("Once upon a time"):
            print(delta, end="")

`EngineConfig` holds the same settings, with the same defaults, as `batcher serve`'s flags (the
flags take their defaults from it). Requests run through the same continuous-batching engine:
concurrent `generate` calls share its steps. The engine starts with the first request and
`close()` (or leaving the `with` block) stops it; there is no `start()` to forget.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Self, TypeVar

from batcher.bundled import DEFAULT_MODEL
from batcher.engine.config import EngineConfig
from batcher.core.sampling import SamplingParams

T = TypeVar("T")
_ids = itertools.count()


@dataclass(slots=True, frozen=True)
class Completion:
    """One finished request: the text, its tokens and why it stopped ("stop", "length")."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0


class GenerationError(RuntimeError):
    """The engine failed the request (or stopped before it finished)."""


class AsyncLLM:
    """The engine for asyncio programs. Construction loads the model (blocking; use
    `await AsyncLLM.load(...)` to load in a thread); every method must then run on one event
    loop, the one of the first request."""

    def __init__(self, model: str = DEFAULT_MODEL, config: EngineConfig | None = None) -> None:
        from batcher.engine.factory import build_engine

        self.model = model
        self.config = replace(config) if config is not None else EngineConfig()
        self._engine = build_engine(model, self.config)
        self._closed = False

    @classmethod
    async def load(cls, model: str = DEFAULT_MODEL, config: EngineConfig | None = None) -> Self:
        """Load in a worker thread, so the event loop keeps serving while weights load."""
        return await asyncio.get_running_loop().run_in_executor(None, cls, model, config)

    @property
    def max_model_len(self) -> int:
        return self._engine.scheduler.config.max_model_len

    def encode(self, text: str) -> list[int]:
        return self._engine.tokenizer.encode(text)

    async def stream(self, prompt: str | Sequence[int],
                     sampling: SamplingParams | None = None) -> AsyncIterator[str]:
        """Yield the text as it is generated. Leaving the loop early aborts the request."""
        async for ev in self._events(prompt, sampling):
            if ev.text:
                yield ev.text

    async def generate(self, prompt: str | Sequence[int],
                       sampling: SamplingParams | None = None) -> Completion:
        """Run one request to its end."""
        text: list[str] = []
        ids: list[int] = []
        async for ev in self._events(prompt, sampling):
            text.append(ev.text)
            ids.extend(ev.token_ids)
            if ev.finished:
                return Completion("".join(text), ids, ev.finish_reason or "stop",
                                  ev.num_prompt_tokens, ev.num_cached_tokens)
        raise GenerationError("the request ended without a final event")

    async def _events(self, prompt: str | Sequence[int], sampling: SamplingParams | None):
        from batcher.core.request import Request

        if self._closed:
            raise GenerationError("this engine is closed")
        sp = replace(sampling) if sampling is not None else SamplingParams()
        sp.validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        await self._engine.start()  # once; every later call is a no-op
        request = Request(f"llm-{next(_ids)}", ids, sp)
        async for ev in self._engine.generate(request):
            if ev.finish_reason == "error":
                raise GenerationError(ev.error or "the engine failed the request")
            yield ev

    async def close(self) -> None:
        """Stop the engine; requests still running end with `GenerationError`."""
        if not self._closed:
            self._closed = True
            await self._engine.stop("the engine was closed")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


class LLM:
    """The engine for scripts: blocking calls, run on an event loop of its own in a background
    thread. A list of prompts is generated concurrently, in shared batches."""

    def __init__(self, model: str = DEFAULT_MODEL, config: EngineConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="batcher-llm",
                                        daemon=True)
        self._thread.start()
        try:
            self._llm: AsyncLLM = self._call(AsyncLLM.load(model, config))
        except BaseException:
            self._stop_loop()
            raise

    @property
    def config(self) -> EngineConfig:
        return self._llm.config

    def generate(self, prompt: str | Sequence[int],
                 sampling: SamplingParams | None = None) -> Completion:
        return self._call(self._llm.generate(prompt, sampling))

    def generate_many(self, prompts: Sequence[str | Sequence[int]],
                      sampling: SamplingParams | None = None) -> list[Completion]:
        """All `prompts` at once (they share the engine's steps), results in their order."""

        async def run() -> list[Completion]:
            return list(await asyncio.gather(*(self._llm.generate(p, sampling)
                                               for p in prompts)))

        return self._call(run())

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self._llm.close())
            finally:
                self._stop_loop()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["LLM", "AsyncLLM", "Completion", "EngineConfig", "GenerationError",
           "SamplingParams"]
