"""The scheduler's prefill pacing: each step's allowance under the time target (`step_budget`),
the burst fill that lifts it, and the first-token deadline that raises a chunk above it.

The scheduler asks `allowance(running, waiting)` once a step and `paced(...)` per prefill
chunk; how much a step may carry is decided here, what runs is decided there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batcher.core.config import SchedulerConfig
from batcher.core.step_budget import PrefillAllowance, deadline_chunk, step_target
from batcher.core.step_time import OnlineStepTimeModel, StepShape
from batcher.core.request import Request

# Fewer requests arriving together are not a burst: a pair's second prompt read at the whole
# budget would stall the first stream for as long, for nothing a batch gains.
BURST_MIN = 4
# A prompt too long for the TTFT SLO even at the whole budget is read evenly beside the streams,
# its first token due this many times its whole-budget reading after arrival; behind that pace,
# its chunks grow to at most LONG_CATCH_UP times the even one.
LONG_READ_PACE = 4.0
LONG_CATCH_UP = 2
# Prompts a late one looks at for one that can still be on time (the queue's head is enough:
# a step has room for the first few).
ON_TIME_SCAN = 8


class PrefillPacer:
    """Sizes prefill by `step_time`, the engine's online model of its own steps."""

    def __init__(self, config: SchedulerConfig, step_time: OnlineStepTimeModel,
                 clock: Callable[[], float], block_size: int) -> None:
        self.config, self.step_time, self.clock = config, step_time, clock
        self.block_size = block_size
        self._queues: tuple[Sequence[Request], Sequence[Request]] = ((), ())

    def allowance(self, running: Sequence[Request],
                  waiting: Sequence[Request]) -> PrefillAllowance | None:
        """This step's prefill allowance under the time target; None when there is no prefill
        to pace, no decode to protect, or a burst fills its batch (prefill then gets the whole
        token budget)."""
        bs = self.block_size
        # NOTE: the decode rows' StepShape, summed as plain ints (a StepShape a row cost a
        # tenth of a 256-stream step): a row's context is its position rounded up to a block.
        rows, last = 0, -1
        for r in running:
            computed = r.num_computed_tokens
            if len(r.token_ids) - computed == 1:
                rows += 1
                if computed > last:
                    last = computed
        if rows == len(running) and not waiting:
            return None  # every row a decode: no prefill to pace this step
        decode = StepShape(rows, -(-(last + 1) // bs) * bs) if rows else StepShape()
        cfg = self.config
        if waiting and len(running) < cfg.max_num_seqs and self.one_burst(running, waiting):
            return None  # a burst's fill (see step_budget)
        # The steady batch: the streams plus the requests waiting to start (see step_budget).
        batch = min(cfg.max_num_seqs, decode.decode_rows + len(waiting))
        target = step_target(self.step_time, decode, cfg.slo_tpot_s, cfg.max_step_slowdown,
                             batch)
        if target is None:
            return None
        self._queues = (running, waiting)  # for `paced`, within this step
        return PrefillAllowance(self.step_time, target, decode, cfg.min_prefill_chunk, bs)

    def one_burst(self, running: Sequence[Request], waiting: Sequence[Request],
                  arriving_at: float | None = None) -> bool:
        """At least BURST_MIN requests are here and every one arrived within
        `burst_window_s` of the first; `arriving_at`: one more request, arriving then."""
        window = self.config.burst_window_s
        extra = arriving_at is not None
        if window <= 0 or len(running) + len(waiting) + extra < BURST_MIN:
            return False
        first = last = (arriving_at if arriving_at is not None
                        else (waiting or running)[0].arrival_time)
        for q in (running, waiting):
            for r in q:
                t = r.arrival_time
                if t < first:
                    first = t
                elif t > last:
                    last = t
                if last - first > window:  # steady traffic ends the scan in a few requests
                    return False
        return True

    def on_time_other(self, req: Request, allowance: PrefillAllowance, chunk: int,
                      now: float) -> bool:
        """Another interactive prompt of this step's queues, not yet answered, can still have
        its first token within the SLO if read at `chunk` tokens a step from now (the first
        ON_TIME_SCAN such prompts are looked at)."""
        slo = self.config.slo_ttft_s
        assert slo is not None
        seen = 0
        for queue in self._queues:
            for r in queue:
                if (r is req or r.first_token_time is not None or r.priority > 0
                        or len(r.token_ids) - r.num_computed_tokens <= 1):
                    continue
                left = slo - (now - r.arrival_time)
                if allowance.seconds_to_read(r.num_computed_tokens, r.num_prompt_tokens,
                                             chunk) <= left:
                    return True
                seen += 1
                if seen >= ON_TIME_SCAN:
                    return False
        return False

    @staticmethod
    def _long_chunk(req: Request, num_computed: int, limit: int, allowance: PrefillAllowance,
                    left_s: float, due_s: float) -> int:
        """A chunk of a prompt too long for the SLO: its whole prompt spread evenly over the
        steps that fit in `due_s`; behind that pace (`left_s` to its due time), up to
        LONG_CATCH_UP times as much, so catching up never takes one step many times the
        others."""
        n = req.num_prompt_tokens
        even = deadline_chunk(n, due_s, allowance.target_s, limit)
        even = deadline_chunk(n, due_s, allowance.step_with(num_computed, even), limit)
        remaining = n - num_computed
        step_s = allowance.step_with(num_computed, even)
        behind = deadline_chunk(remaining, left_s, step_s, limit) if left_s > step_s else limit
        return min(limit, remaining, max(even, min(behind, LONG_CATCH_UP * even)))

    def paced(self, req: Request, num_computed: int, limit: int,
              allowance: PrefillAllowance) -> int:
        """The chunk the time target allows, raised to what the request's first-token deadline
        needs (an interactive prompt not yet answered, under a TTFT SLO, short enough to be read
        within it, and not late while another can still be on time; see step_budget)."""
        num_new = allowance.chunk(num_computed, limit)
        cfg = self.config
        slo = cfg.slo_ttft_s
        if slo is None or req.first_token_time is not None or req.priority > 0:
            return num_new
        whole = cfg.max_num_batched_tokens - allowance.shape.decode_rows
        if cfg.long_prefill_token_threshold > 0:
            whole = min(whole, cfg.long_prefill_token_threshold)
        whole = max(1, whole)
        alone_s = allowance.seconds_to_read(0, req.num_prompt_tokens, whole)
        now = self.clock()
        since = now - req.arrival_time
        remaining = req.num_prompt_tokens - num_computed
        if alone_s > slo:
            # Too long for the SLO at any pace: not held to it (nor by admission). As the step's
            # first chunk (the longest-waiting prompt), it is read evenly, so that its first
            # token comes within LONG_READ_PACE times its whole-budget reading, never in a few
            # steps many times the streams' (at the target alone, a slow machine's small chunks
            # would take minutes); behind another chunk, it gets the target's share only.
            if allowance.booked:
                return num_new
            return max(num_new, self._long_chunk(req, num_computed, limit, allowance,
                                                 LONG_READ_PACE * alone_s - since,
                                                 LONG_READ_PACE * alone_s))
        if (allowance.seconds_to_read(num_computed, req.num_prompt_tokens, whole) > slo - since
                and self.on_time_other(req, allowance, whole, now)):
            return num_new  # late because it waited: it yields to a first token still on time
        left = cfg.ttft_pace * slo - since
        need = deadline_chunk(remaining, left, allowance.target_s, limit)
        # Steps that carry the needed chunk are longer than the target: size it again on them.
        need = deadline_chunk(remaining, left, allowance.step_with(num_computed, need), limit)
        return max(num_new, need)
