"""What the simulated clients send, and when.

Arrival processes (`ArrivalSpec`): Poisson at a rate, bursts (N every T seconds), a diurnal curve
(Poisson whose rate follows a sine between `1 - amplitude` and `1 + amplitude` times the mean,
drawn by thinning), or all at t = 0. They are generators, so a ten-minute run at hundreds of
requests per second never holds its whole schedule.

Request shapes (`ShapeSpec`): lognormal input and output lengths (median and sigma of the
underlying normal, clipped), and optionally a shared prefix: `prefix_groups` system prompts of
`prefix_tokens` tokens, one drawn per request, so the block pool's prefix cache sees real hits.
A workload file (the `workloads/*.json` format) replaces the lognormal draws by its requests,
cycled. Token ids are ranges (cheap to build); their values only matter to the prefix cache.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ARRIVALS = ("poisson", "burst", "diurnal", "all")


@dataclass(slots=True, frozen=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = 1.0  # mean requests/s (poisson, diurnal)
    burst_size: int = 32
    burst_interval: float = 10.0
    amplitude: float = 0.5  # diurnal: rate swings between (1 -/+ amplitude) x rate
    period: float = 600.0  # diurnal: seconds per cycle; the run starts at the trough
    count: int = 0  # "all": requests at t = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {ARRIVALS}")
        if self.kind in ("poisson", "diurnal") and not self.rate > 0:
            raise ValueError("Poisson and diurnal arrivals need a rate > 0")
        if self.kind == "burst" and (self.burst_size < 1 or not self.burst_interval > 0):
            raise ValueError("bursts need a size >= 1 and an interval > 0")
        if not 0 <= self.amplitude < 1:
            raise ValueError("the diurnal amplitude must be in [0, 1)")

    def rate_at(self, t: float) -> float:
        if self.kind == "diurnal":
            return self.rate * (1 - self.amplitude * math.cos(2 * math.pi * t / self.period))
        if self.kind == "burst":
            return self.burst_size / self.burst_interval
        return self.rate

    def times(self, duration: float, rng: random.Random) -> Iterator[float]:
        """Arrival times in [0, duration), increasing."""
        if self.kind == "all":
            yield from (0.0 for _ in range(self.count))
            return
        t = 0.0
        if self.kind == "burst":
            while t < duration:
                yield from (t for _ in range(self.burst_size))
                t += self.burst_interval
            return
        peak = self.rate * (1 + self.amplitude) if self.kind == "diurnal" else self.rate
        while True:
            t += rng.expovariate(peak)
            if t >= duration:
                return
            if self.kind == "poisson" or rng.random() * peak < self.rate_at(t):
                yield t


@dataclass(slots=True, frozen=True)
class ShapeSpec:
    input_median: float = 256
    input_sigma: float = 0.6
    output_median: float = 64
    output_sigma: float = 0.6
    min_input: int = 8
    max_input: int = 1024
    min_output: int = 4
    max_output: int = 512
    prefix_groups: int = 0  # shared system prompts; 0 = none
    prefix_tokens: int = 0
    workload_file: str | None = None

    def mean_tokens(self, n: int = 20_000, seed: int = 1) -> tuple[float, float]:
        """Mean (input, output) tokens of this shape, by drawing `n` requests."""
        gen = RequestGen(self, seed)
        ins = outs = 0
        for _ in range(n):
            p, o, _g = gen.lengths()
            ins += p
            outs += o
        return ins / n, outs / n


class RequestGen:
    """Draws request prompts (token-id lists) and output lengths from a `ShapeSpec`."""

    def __init__(self, spec: ShapeSpec, seed: int = 0) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.n = 0
        self.file: list[tuple[list[int], int]] = []
        if spec.workload_file:
            data = json.loads(Path(spec.workload_file).read_text())
            reqs = data["requests"] if isinstance(data, dict) else data
            for r in reqs:
                ids = r["prompt_ids"]
                ids = json.loads(ids) if isinstance(ids, str) else ids
                self.file.append(([int(x) for x in ids], int(r["max_new_tokens"])))
        self.prefixes = [list(range(10_000 + g * spec.prefix_tokens,
                                    10_000 + (g + 1) * spec.prefix_tokens))
                         for g in range(spec.prefix_groups)]

    def _draw(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return min(hi, max(lo, round(self.rng.lognormvariate(math.log(median), sigma))))

    def lengths(self) -> tuple[int, int, int]:
        """(prompt tokens, output tokens, prefix group or -1) of the next request."""
        s = self.spec
        if self.file:
            ids, out = self.file[self.n % len(self.file)]
            self.n += 1
            return len(ids), out, -1
        self.n += 1
        p = self._draw(s.input_median, s.input_sigma, s.min_input, s.max_input)
        o = self._draw(s.output_median, s.output_sigma, s.min_output, s.max_output)
        g = self.rng.randrange(s.prefix_groups) if s.prefix_groups else -1
        return max(p, s.prefix_tokens + 1 if g >= 0 else 1), o, g

    def prompt(self, index: int, length: int, group: int) -> list[int]:
        """The prompt's token ids: the group's prefix, then ids unique to this request."""
        if self.file:
            return self.file[index % len(self.file)][0]
        base = 1_000_000 + index * (self.spec.max_input + 1)
        if group < 0:
            return list(range(base, base + length))
        pre = self.prefixes[group]
        return pre + list(range(base, base + length - len(pre)))
