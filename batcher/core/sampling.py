"""Sampling parameters: what a request asks of the sampler. Pure Python (no torch), so `core/` can
carry them; the batched sampler that applies them lives in `runtime/sampler.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules. `validate()` raises ValueError on bad input."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on text
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop token ids
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token's logprob plus top-k
    # None = off; k >= 0 = each prompt token's logprob (after the first) plus its top-k.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # Penalties as OpenAI and vLLM define them: presence and frequency subtract from the logits
    # of tokens already generated (once, and once per occurrence); repetition divides a positive
    # logit (multiplies a negative one) of any token in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability; 0 = off
    # A compiled grammar (see `batcher.structured.grammars`) the output must follow; None = free text.
    grammar: str | None = None

    @property
    def needs_history(self) -> bool:
        """Whether the sampler must see the sequence's tokens so far (penalties; a grammar, to
        rebuild its state after preemption)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar is not None)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (penalties, bias, min_p)."""
        return self.needs_history or bool(self.logit_bias) or (self.min_p > 0 and not self.greedy)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 disables it)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError("seed must be an integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError("min_tokens must be an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be between -2 and 2")
        rp = self.repetition_penalty
        if not (isinstance(rp, (int, float)) and 0.0 < rp <= 10.0):
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be between 0 and 1")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
                not isinstance(k, int) or k < 0 or not -100.0 <= v <= 100.0
                for k, v in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids to numbers between -100 and 100")
        return self
