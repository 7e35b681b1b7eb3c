"""Quality of a quantized model against its unquantized self: greedy agreement and perplexity on a
held-out text, both on the real paged forward."""

from __future__ import annotations

import math

import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from tests.greedy_loop import greedy_generate

# Not in any prompt the tests generate from: a held-out paragraph for perplexity.
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth for the lens. From the gallery he could see the fishing boats returning "
    "to the harbour, their lamps bobbing on the dark water. In winter the storms came from the "
    "west, and the spray reached the windows of the lamp room; in summer the sea was so calm "
    "that he could hear the bell of the church in the village three miles away."
)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small town,",
           "The three primary colors are")


def perplexity(runner: ModelRunner, tokens: list[int]) -> float:
    """exp(mean negative log-likelihood of tokens[1:]), teacher-forced in one prefill."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    sched = SchedulerOutput([ScheduledSeq("p", tokens, 0, blocks, True, SamplingParams())])
    ids, positions, meta, _, _ = runner.prepare(sched)
    logits = runner.model(ids, positions, meta, runner.kv_caches, torch.arange(len(tokens)))
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal up to each pair's first difference (after it the contexts
    differ, so later tokens say nothing about the weights): mean common-prefix length / length."""
    total = same = 0
    for x, y in zip(a, b):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        same += n
        total += len(x)
    return same / total


def quality(runner: ModelRunner, reference: ModelRunner, tokenizer, new_tokens: int,
            suppress: tuple[int, ...]) -> tuple[float, float, float]:
    """-> (greedy agreement, perplexity of runner, perplexity of reference)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    got = greedy_generate(runner, prompts, new_tokens, suppress)
    want = greedy_generate(reference, prompts, new_tokens, suppress)
    held = tokenizer.encode(HELD_OUT)
    return agreement(got, want), perplexity(runner, held), perplexity(reference, held)
