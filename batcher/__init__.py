"""batcher: an OpenAI-compatible LLM server over a continuous-batching engine, and the same engine
in your own program.

    from batcher import LLM, SamplingParams

    with LLM() as llm:  # the bundled SmolLM2-135M
        print(llm.generate("The capital of France is", SamplingParams(max_tokens=8)).text)

`AsyncLLM` is the asyncio form; `EngineConfig` holds the engine settings with `batcher serve`'s
defaults; `Batcher` groups calls of a fixed-shape function by size or timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "AsyncLLM", "Batcher", "Completion", "EngineConfig", "GenerationError",
           "SamplingParams", "__version__"]

# The names load on first use: `import batcher` (every CLI command does) must not pull in the
# engine and torch.
_WHERE = {"LLM": "batcher.llm", "AsyncLLM": "batcher.llm", "Completion": "batcher.llm",
          "GenerationError": "batcher.llm", "EngineConfig": "batcher.engine.config",
          "SamplingParams": "batcher.core.sampling", "Batcher": "batcher.flusher.flusher"}

if TYPE_CHECKING:
    from batcher.engine.config import EngineConfig
    from batcher.flusher.flusher import Batcher
    from batcher.llm import LLM, AsyncLLM, Completion, GenerationError
    from batcher.core.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("batcher")
        except PackageNotFoundError:
            return "unknown"
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'batcher' has no attribute {name!r}")
