"""When requests are sent: all at once, Poisson at a rate, bursts, or C closed-loop users.

Open-loop patterns (all, Poisson, bursts) send on a schedule whatever the server does, so a slow
server sees its queue grow, as it would in production; a closed loop sends a user's next request
only when the previous one ended, so it measures the latency at a fixed concurrency instead.
Every run is bounded: by a request count, a duration, or both (whichever comes first).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

KINDS = ("all", "poisson", "burst", "closed")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Arrivals:
    kind: str = "all"
    num_requests: int | None = None
    duration: float | None = None
    rate: float = 1.0
    burst_size: int = 8
    burst_interval: float = 1.0
    concurrency: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"arrivals must be one of {KINDS}, got {self.kind!r}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("a run needs a request count or a duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the request count must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("the duration must be > 0")
        if self.kind == "all" and self.num_requests is None:
            raise ValueError("all-at-once arrivals need a request count")
        if self.kind == "poisson" and not self.rate > 0:
            raise ValueError("Poisson arrivals need a rate > 0")
        if self.kind == "burst" and (self.burst_size < 1 or not self.burst_interval > 0):
            raise ValueError("bursts need a size >= 1 and an interval > 0")
        if self.kind == "closed" and self.concurrency < 1:
            raise ValueError("a closed loop needs at least one user")

    def describe(self) -> str:
        bound = " and ".join(x for x in (
            f"{self.num_requests} requests" if self.num_requests else "",
            f"{self.duration:g} s" if self.duration else "") if x)
        what = {"all": "all at t=0", "poisson": f"Poisson {self.rate:g}/s",
                "burst": f"bursts of {self.burst_size} every {self.burst_interval:g} s",
                "closed": f"closed loop, {self.concurrency} users"}[self.kind]
        return f"{what}, {bound}"

    @property
    def offered_rate(self) -> float | None:
        """Requests per second offered by an open-loop schedule (None: all at once, closed)."""
        if self.kind == "poisson":
            return self.rate
        if self.kind == "burst":
            return self.burst_size / self.burst_interval
        return None

    def offsets(self) -> list[float]:
        """Send times in seconds from the start, for the open-loop kinds."""
        if self.kind == "closed":
            raise ValueError("a closed loop has no schedule")
        rng = random.Random(self.seed)
        limit = self.duration if self.duration is not None else float("inf")
        out: list[float] = []
        t = 0.0
        for i in itertools.count():
            if self.num_requests is not None and i >= self.num_requests:
                break
            if self.kind == "burst":
                t = (i // self.burst_size) * self.burst_interval
            elif self.kind == "poisson" and i > 0:
                t += rng.expovariate(self.rate)
            if t >= limit:
                break
            out.append(t)
        return out


async def drive(arr: Arrivals, send: Callable[[int], Awaitable[R]]) -> list[R]:
    """Call send(i) for request i = 0, 1, ... on the arrival pattern; results in send order."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    if arr.kind != "closed":
        tasks: list[asyncio.Task[R]] = []
        for i, offset in enumerate(arr.offsets()):
            delay = t0 + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        return list(await asyncio.gather(*tasks))

    counter = itertools.count()
    done: list[tuple[int, R]] = []

    async def user() -> None:
        while True:
            if arr.duration is not None and loop.time() - t0 >= arr.duration:
                return
            i = next(counter)
            if arr.num_requests is not None and i >= arr.num_requests:
                return
            done.append((i, await send(i)))

    await asyncio.gather(*(user() for _ in range(arr.concurrency)))
    return [r for _, r in sorted(done, key=lambda x: x[0])]
