"""Latency anatomy: one request's time split into phases on one monotonic clock, from the moment
its HTTP request is received to the moment its answer is written.

    parse     read the body, JSON, validation
    tokenize  chat template and tokenizer (and the context and admission checks that follow)
    queue     every wait for the engine: before the first step and again after each preemption
    prefill   first scheduled step -> first token (less any re-queueing in between)
    decode    first token -> last token (less any re-queueing in between)
    post      last token -> answer written: detokenize, stop matching, serialization, writing

The phases add up to `total` by construction: they are the gaps between consecutive marks, each
mark clamped to lie between its neighbours, and re-queueing is moved from the phase it interrupted
to `queue`. A router adds `route` (its own share: choosing, connecting, relaying)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PHASES = ("parse", "tokenize", "queue", "prefill", "decode", "post")
ROUTER_PHASES = ("route", *PHASES)


@dataclass(slots=True)
class EngineTimes:
    """What the engine knows of one request, on the final event (monotonic seconds)."""

    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    requeue_before_first_token: float = 0.0  # waiting again after a preemption, by when
    requeue_after_first_token: float = 0.0
    preemptions: int = 0


class PhaseClock:
    """The gateway-side marks of one HTTP request."""

    __slots__ = ("clock", "parsed", "received", "tokenized")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 received: float | None = None) -> None:
        self.clock = clock
        self.received = clock() if received is None else received
        self.parsed: float | None = None
        self.tokenized: float | None = None

    def mark_parsed(self) -> None:
        self.parsed = self.clock()

    def mark_tokenized(self) -> None:
        self.tokenized = self.clock()


@dataclass(slots=True)
class Timings:
    """Milliseconds per phase and the request's token counts: the `timings` object."""

    parse_ms: float = 0.0
    tokenize_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    post_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    route_ms: float | None = None  # only through a router

    def phases(self) -> dict[str, float]:
        out: dict[str, float] = {} if self.route_ms is None else {"route": self.route_ms}
        out.update(parse=self.parse_ms, tokenize=self.tokenize_ms, queue=self.queue_ms,
                   prefill=self.prefill_ms, decode=self.decode_ms, post=self.post_ms)
        return out

    @property
    def bottleneck(self) -> str:
        """The phase that took the largest share of the total (the first such, in the order of
        `phases()`). Spelled out: a router computes it for every relayed answer."""
        name, best = ("route", self.route_ms) if self.route_ms is not None else (
            "parse", self.parse_ms)
        for phase, ms in (("parse", self.parse_ms), ("tokenize", self.tokenize_ms),
                          ("queue", self.queue_ms), ("prefill", self.prefill_ms),
                          ("decode", self.decode_ms), ("post", self.post_ms)):
            if ms > best:
                name, best = phase, ms
        return name

    def to_json(self) -> dict[str, Any]:
        # Spelled out rather than looped: a router writes one per relayed answer.
        out: dict[str, Any] = {} if self.route_ms is None else {
            "route_ms": round(self.route_ms, 3)}
        out.update(parse_ms=round(self.parse_ms, 3), tokenize_ms=round(self.tokenize_ms, 3),
                   queue_ms=round(self.queue_ms, 3), prefill_ms=round(self.prefill_ms, 3),
                   decode_ms=round(self.decode_ms, 3), post_ms=round(self.post_ms, 3),
                   total_ms=round(self.total_ms, 3), prompt_tokens=self.prompt_tokens,
                   cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens,
                   preemptions=self.preemptions, bottleneck=self.bottleneck)
        return out

    def server_timing(self) -> str:
        """The `Server-Timing` header value (durations in milliseconds)."""
        route = "" if self.route_ms is None else f"route;dur={self.route_ms:.3f}, "
        return (f"{route}parse;dur={self.parse_ms:.3f}, tokenize;dur={self.tokenize_ms:.3f}, "
                f"queue;dur={self.queue_ms:.3f}, prefill;dur={self.prefill_ms:.3f}, "
                f"decode;dur={self.decode_ms:.3f}, post;dur={self.post_ms:.3f}, "
                f"total;dur={self.total_ms:.3f}")

    @classmethod
    def from_json(cls, obj: Any) -> Timings | None:
        """A `timings` object read back (a router, a benchmark, `diagnose`); None if malformed."""
        if not isinstance(obj, dict):
            return None
        get = obj.get  # spelled out, field by field: a router reads one per relayed answer
        try:
            t = cls(float(get("parse_ms", 0.0)), float(get("tokenize_ms", 0.0)),
                    float(get("queue_ms", 0.0)), float(get("prefill_ms", 0.0)),
                    float(get("decode_ms", 0.0)), float(get("post_ms", 0.0)),
                    float(obj["total_ms"]), int(get("prompt_tokens", 0)),
                    int(get("cached_tokens", 0)), int(get("completion_tokens", 0)),
                    int(get("preemptions", 0)))
            if (route := get("route_ms")) is not None:
                t.route_ms = float(route)
        except (KeyError, TypeError, ValueError):
            return None
        return t

    def through_router(self, router_total_ms: float) -> Timings:
        """This replica's timings as seen by a router whose own total was `router_total_ms`:
        `route` is the difference (routing, connecting, relaying), never negative."""
        total = max(router_total_ms, self.total_ms)
        return Timings(parse_ms=self.parse_ms, tokenize_ms=self.tokenize_ms,
                       queue_ms=self.queue_ms, prefill_ms=self.prefill_ms,
                       decode_ms=self.decode_ms, post_ms=self.post_ms, total_ms=total,
                       prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                       completion_tokens=self.completion_tokens, preemptions=self.preemptions,
                       route_ms=total - self.total_ms)


def split(marks: PhaseClock, engine: EngineTimes | None, end: float) -> Timings:
    """The phases of one request that was received at `marks.received` and ended at `end`."""
    start = marks.received
    bounds = [start]
    eng = engine or EngineTimes()
    last_token = eng.last_token if eng.last_token is not None else eng.first_token
    # Missing marks (a request refused, aborted or failed before a phase) take the previous one:
    # that phase, and the ones after it up to the next known mark, are zero.
    for mark in (marks.parsed, marks.tokenized, eng.first_scheduled, eng.first_token,
                 last_token):
        bounds.append(min(end, max(bounds[-1], mark if mark is not None else bounds[-1])))
    bounds.append(max(end, bounds[-1]))
    parse, tokenize, queue, prefill, decode, post = (
        b - a for a, b in itertools.pairwise(bounds))
    # A request that ended before a phase (refused, failed, cancelled) spent the rest of its
    # time in the phase it was in.
    rest = bounds[-1] - start
    if marks.parsed is None:
        parse, tokenize, queue, prefill, decode, post = rest, 0.0, 0.0, 0.0, 0.0, 0.0
    elif marks.tokenized is None:
        tokenize, queue, prefill, decode, post = rest - parse, 0.0, 0.0, 0.0, 0.0
    elif eng.first_scheduled is None:
        queue, prefill, decode, post = queue + prefill + decode + post, 0.0, 0.0, 0.0
    # Re-queueing after a preemption is waiting, whatever phase it interrupted.
    back = min(prefill, eng.requeue_before_first_token)
    prefill -= back
    later = min(decode, eng.requeue_after_first_token)
    decode -= later
    queue += back + later
    ms = 1000.0
    return Timings(parse * ms, tokenize * ms, queue * ms, prefill * ms, decode * ms, post * ms,
                   (bounds[-1] - start) * ms, preemptions=eng.preemptions)
