"""Run the batcher engine inside a program, without a server.

    python examples/embed_engine.py "The capital of France is"

Loads the bundled SmolLM2-135M, completes one prompt greedily, then three prompts at once (they
share the engine's batched steps), then streams one with asyncio.
"""

from __future__ import annotations

import asyncio
import sys

from batcher import LLM, AsyncLLM, EngineConfig, SamplingParams


def main(prompt: str) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    # EngineConfig's defaults are `batcher serve`'s; set only what differs.
    with LLM("smollm2-135m", EngineConfig(max_num_seqs=8)) as llm:
        one = llm.generate(prompt, greedy)
        print(f"{prompt!r} -> {one.text!r} ({len(one.token_ids)} tokens, {one.finish_reason})")
        for p, result in zip(["1, 2, 3,", "Paris is", "def add(a, b):"],
                             llm.generate_many(["1, 2, 3,", "Paris is", "def add(a, b):"],
                                               greedy), strict=True):
            print(f"{p!r} -> {result.text!r}")

    async def stream() -> None:
        async with await AsyncLLM.load("smollm2-135m") as engine:
            print("streamed: ", end="")
            async for delta in engine.stream(prompt, greedy):
                print(delta, end="", flush=True)
            print()

    asyncio.run(stream())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "The capital of France is")
