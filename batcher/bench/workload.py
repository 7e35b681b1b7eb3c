"""What a benchmark sends: requests from a workload file, or synthetic ones.

Synthetic requests draw input and output lengths from lognormal distributions (median and spread,
the spread being sigma of the underlying normal) so a few long requests sit among many short ones,
as in real chat traffic. An optional shared system prompt of N tokens leads every prompt, for
prefix-cache studies. Everything is drawn from one seeded generator: a seed names a workload.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

from batcher.bench.common import load_workload

# Words that are one token with a leading space in common BPE vocabularies, so a text prompt of
# N words is about N tokens on most models (chat endpoints only take text).
_WORD_TEXT = ("the of and to in is it that for was on are as with his they at be this from have or "
          "by one had not but what all were when we there can an your which their said if do "
          "will each about how up out them then she many some so these would other into has "
          "more her two like him see time could no make than first been its who now people my "
          "made over did down only way find use may water long little very after words called "
          "just where most know get through back much before go good new write our used me man "
          "too any day same right look think also around another came come work three word "
          "must because does part even place well such here take why things help put years "
          "different away again off went old number great tell men say small every found still "
          "between name should home big give air line set own under read last never us left end "
          "along while might next sound below saw something thought both few those always looked "
          "show large often together asked house world going want school important until form "
          "food keep children feet land side without boy once animals life enough took sometimes "
          "four head above kind began almost live page got earth need far hand high year mother "
          "light parts country father let night following picture being study second eyes soon "
          "times story boys since white days ever paper hard near sentence better best across "
          "during today others however sure means knew try told young miles sun ways thing whole "
          "hear example heard several change answer room sea against top turned learn point city "
          "play toward five using himself usually")
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(slots=True)
class BenchRequest:
    """One request to send: token ids and/or text, and how many tokens to ask for."""

    id: str
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        """Prompt tokens (exact with ids; the word count, about the token count, with text)."""
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        return len((self.prompt_text or "").split())


def from_file(path: str | os.PathLike[str] | None = None, limit: int | None = None
              ) -> list[BenchRequest]:
    """A workload file in the shared format (prompt_ids, prompt_text, max_new_tokens)."""
    return [BenchRequest(r["id"], r["prompt_ids"], r["prompt_text"], r["max_new_tokens"])
            for r in load_workload(path, limit)]


def lognormal_lengths(rng: random.Random, n: int, median: float, sigma: float,
                      low: int, high: int) -> list[int]:
    """n integers from a lognormal with the given median, clipped to [low, high]."""
    if median <= 0 or sigma < 0:
        raise ValueError("a length distribution needs median > 0 and spread >= 0")
    mu = math.log(median)
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def synthetic(n: int, *, input_median: float = 256, input_spread: float = 0.5,
              output_median: float = 128, output_spread: float = 0.5,
              shared_prefix_tokens: int = 0, seed: int = 0, min_input: int = 4,
              max_input: int = 4096, min_output: int = 1, max_output: int = 2048,
              token_low: int = 1000, token_high: int = 30000) -> list[BenchRequest]:
    """n seeded synthetic requests; the input length counts the shared prefix too.

    Token ids are drawn from [token_low, token_high), away from the special tokens at the bottom
    of most vocabularies; the same draw gives a word prompt for chat endpoints.
    """
    if n < 1:
        raise ValueError("a synthetic workload needs at least one request")
    if not 0 <= token_low < token_high:
        raise ValueError("token ids need 0 <= token_low < token_high")
    rng = random.Random(seed)
    ins = lognormal_lengths(rng, n, input_median, input_spread, min_input, max_input)
    outs = lognormal_lengths(rng, n, output_median, output_spread, min_output, max_output)
    prefix = [rng.randrange(token_low, token_high) for _ in range(shared_prefix_tokens)]
    out = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs)):
        # The unique part is at least one token, so no two prompts are identical.
        own = [rng.randrange(token_low, token_high)
               for _ in range(max(1, n_in - shared_prefix_tokens))]
        ids = prefix + own
        text = " ".join(_WORDS[t % len(_WORDS)] for t in ids)
        out.append(BenchRequest(f"syn-{seed}-{i}", ids, text, n_out))
    return out


def take(workload: list[BenchRequest], i: int) -> BenchRequest:
    """The i-th request of a run; a run longer than its workload cycles through it again."""
    r = workload[i % len(workload)]
    rid = r.id if i < len(workload) else f"{r.id}-{i // len(workload)}"
    return BenchRequest(rid, r.prompt_ids, r.prompt_text, r.max_tokens)
