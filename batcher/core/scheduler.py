"""One scheduling loop under a token budget: running requests first, then waiting ones.

There is no prefill phase. Each request has `num_computed_tokens`; each step hands out up to
`max_num_batched_tokens` tokens to at most `max_num_seqs` sequences: a decode is one token, a prompt
(or a preempted request's recompute) is a chunk of whatever budget is left. While streams decode,
a step-time model sizes the chunks so the step stays within their time-per-token target
(`prefill_pacing.py`, `step_budget.py`). When a running request cannot get a block, the
lowest-priority, newest running request is preempted (recomputed later). Finish, abort and
preemption all release resources through `_free`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.ngram_proposer import NgramProposer, can_speculate
from batcher.core.outputs import (
    PENDING_TOKEN,
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
    TokenLogprobs,
)
from batcher.core.refusals import DuplicateRequestId, EmptyPrompt, ExceedsContext, ExceedsKvCapacity
from batcher.core.scheduled_rows import decode_row, scheduled_row
from batcher.core.prefill_pacing import PrefillPacer
from batcher.core.step_budget import PrefillAllowance
from batcher.core.step_time import OnlineStepTimeModel
from batcher.core.step_updates import RequestUpdate, SchedulerStats
from batcher.core.stopping import stop_status
from batcher.core.request import Request, RequestStatus

# Prompt positions one request scores (prompt logprobs) per step, at most.
MAX_SCORED_CHUNK = 512


def _count_decodes(running: list[Request], start: int) -> int:
    """How many of `running[start:]` are decodes (one token left to compute)."""
    return sum(1 for r in running[start:] if len(r.token_ids) - r.num_computed_tokens == 1)


def _running_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


def _waiting_key(req: Request) -> tuple[int, int, float]:
    # NOTE: a preempted request goes to the head of its priority class: it already waited, and
    # its prefix is probably still cached.
    return (req.priority, 0 if req.num_preemptions else 1, req.arrival_time)


class Scheduler:
    """Decides each step's work. Not thread-safe: call it from the engine's loop only.

    Per step: `schedule()` -> run the model -> `update(out, runner_out)`. `finish()` may be
    called while a step runs (the engine schedules the next step before it emits this one's
    text): the blocks it frees are handed out only by a later `schedule()`, and `update()`
    drops that step's row of the finished request. `abort()` may be called at any time: the
    request is freed at the next `schedule()`.

    `step_time`: the model of step time the caller feeds with measured steps; with it (and
    `prefill_budget="time"`) prefill chunks are sized to the TPOT target. Without it every step
    gets the fixed token budget.
    """

    def __init__(
        self,
        sched_config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        debug_checks: bool = False,
        step_time: OnlineStepTimeModel | None = None,
    ) -> None:
        self.config = sched_config.validate()
        self.kv = kv
        self.step_time = step_time if self.config.prefill_budget == "time" else None
        self.pacer = (None if self.step_time is None else
                      PrefillPacer(self.config, self.step_time, clock, kv.block_size))
        # The last step's allowance (None when it had no time target): for tests and metrics.
        self.last_allowance: PrefillAllowance | None = None
        self.clock = clock
        self.debug_checks = debug_checks
        self.stats = SchedulerStats()
        # Sorted by `_waiting_key`; `running` by `_running_key`, so its tail is the next victim.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._pending_aborts: dict[str, None] = {}
        self._freed_ids: list[str] = []
        self._freed: list[Request] = []
        # Bumped by every change to the queues or a request's progress: a reader may keep what
        # it computed from them until this moves (`batcher.engine.snapshot.UnservedPrefill`).
        self.changes = 0
        self.proposer = (NgramProposer(self.config.num_speculative_tokens)
                         if self.config.speculative == "ngram" else None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id (finished ones are forgotten)."""
        return self._requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises a `Refused` (a client error) when it can never run: a
        duplicate id, an empty prompt, prompt + max_tokens over `max_model_len`, or more KV than
        the whole pool holds; `ValueError` for invalid sampling parameters."""
        if req.request_id in self._requests:
            raise DuplicateRequestId(f"request id {req.request_id!r} is already running")
        if req.num_prompt_tokens == 0:
            raise EmptyPrompt("the prompt is empty")
        req.sampling.validate()
        total = req.num_prompt_tokens + req.sampling.max_tokens
        if total > self.config.max_model_len:
            raise ExceedsContext(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.sampling.max_tokens}) exceeds the model's {self.config.max_model_len}"
            )
        # NOTE: the last sampled token is never fed back, so it needs no KV slot.
        if self.kv.blocks_needed(total - 1) > self.kv.num_total_blocks:
            raise ExceedsKvCapacity(
                f"the request needs more KV than this server holds ({total} tokens)")
        assert req.status is RequestStatus.WAITING and not req.block_ids
        assert req.num_computed_tokens == 0 and req.num_tokens == req.num_prompt_tokens
        self._requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=_waiting_key)
        self.changes += 1

    def abort(self, request_id: str) -> bool:
        """Queue an abort; the request is freed at the start of the next `schedule()` and gets no
        further updates. Returns whether the id was known (unfinished)."""
        if request_id not in self._requests:
            return False
        self._pending_aborts[request_id] = None
        return True

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a request now (e.g. a stop string matched on text), between steps. Returns whether
        the id was known (unfinished)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._free(req, status)
        return True

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences. Decodes come first in the output, then prefill chunks."""
        self._free_aborted()

        self.changes += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted = False

        # Running requests, highest priority and oldest first.
        # NOTE: a prefill chunk leaves one token of budget for each decode behind it, so a long
        # prompt of a high-priority request never stalls the streams already decoding.
        # Counted where first needed (a row off the decode fast path): until then nothing reads
        # it, and a step of decodes alone never needs it.
        decodes_left = -1
        pacer = self.pacer
        allowance = self.last_allowance = (
            None if pacer is None else pacer.allowance(self.running, self.waiting))
        i = 0
        running = self.running
        proposer = self.proposer
        slots_per_block = self.kv.block_size
        while i < len(running) and budget > 0 and len(seqs) < cfg.max_num_seqs:
            req = running[i]
            drafts: list[int] = []
            if len(req.token_ids) - req.num_computed_tokens == 1:
                if proposer is None and (req.num_computed_tokens
                                         < len(req.block_ids) * slots_per_block):
                    # NOTE: the common case, a decode whose slot its blocks already hold: what
                    # the general path below does for it, without its checks.
                    seqs.append(decode_row(req))
                    budget -= 1
                    i += 1
                    if decodes_left > 0:  # counted already (for a row before this one)
                        decodes_left -= 1
                    continue
                if decodes_left < 0:
                    decodes_left = _count_decodes(running, i)
                decodes_left -= 1
                num_new = 1
                drafts = self._drafts(req, budget - 1 - decodes_left)
            elif budget > (decodes_left if decodes_left >= 0
                           else (decodes_left := _count_decodes(running, i))):
                num_new = self._chunk(req, req.num_computed_tokens, budget - decodes_left)
                if pacer is not None and allowance is not None:
                    num_new = pacer.paced(req, req.num_computed_tokens, num_new, allowance)
                    if num_new == 0:
                        i += 1
                        continue
            else:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new, num_lookahead=len(drafts)):
                if drafts:  # NOTE: speculation never preempts anyone: retry without drafts
                    drafts = []
                    continue
                # NOTE: the tail of `running` is the lowest-priority, newest request; it is never
                # one scheduled earlier in this loop, so no budget needs refunding.
                victim = self.running[-1]
                if victim is not req and victim.num_tokens - victim.num_computed_tokens == 1:
                    decodes_left -= 1
                self._free(victim, RequestStatus.WAITING)
                preempted = True
                if victim is req:
                    break
            else:
                if allowance is not None and req.num_tokens - req.num_computed_tokens > 1:
                    allowance.take(num_new, req.num_computed_tokens)
                seqs.append(scheduled_row(req, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1

        # Waiting requests by (priority, arrival); none in a step that preempted, because the
        # freed blocks were needed by the running ones (admitting would just thrash).
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting[0]
            computed, num_hit = self.kv.get_computed_blocks(req)
            if req.prompt_unscored:
                # NOTE: cached blocks skip their positions' logits, so a request that wants
                # prompt logprobs reuses only blocks already scored (before a preemption).
                keep = min(num_hit, req.num_prompt_scored) // self.kv.block_size
                computed, num_hit = computed[:keep], keep * self.kv.block_size
            num_new = self._chunk(req, num_hit, budget)
            if pacer is not None and allowance is not None:
                # NOTE: the time target is spent: the head waits for the next step, and the
                # requests behind it with it (strict order, as below).
                num_new = pacer.paced(req, num_hit, num_new, allowance)
                if num_new == 0:
                    break
            if not self.kv.allocate_slots(req, num_new, computed):
                # NOTE: strict order: a large request at the head is not overtaken forever.
                break
            if allowance is not None:
                allowance.take(num_new, num_hit)
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            self.stats.prefix_hit_tokens += num_hit
            self.stats.prefix_query_tokens += req.num_tokens
            bisect.insort(self.running, req, key=_running_key)
            seqs.append(scheduled_row(req, num_new))
            budget -= num_new

        # Puts decodes first.
        out = SchedulerOutput(seqs=seqs, freed_ids=self._freed_ids, freed=self._freed)
        self._freed_ids, self._freed = [], []
        self.stats.steps += 1
        if self.debug_checks:
            self.check_integrity()
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `prev`, scheduled while `prev` runs, before its tokens are known
        (`prev` is scheduled and not yet updated): each of its rows one position on, its input
        `PENDING_TOKEN`, the token `prev` samples for it (`fill_pending_inputs`). So the model
        can start the step as soon as `prev` ends, without waiting for the host.

        Only in steady decoding. None, and `schedule()` decides the step once `prev`'s tokens
        are applied, unless every row of `prev` is a plain decode (one token, sampled, no
        drafts, no prompt positions scored, no history for penalties or a grammar, no token held
        back by `min_tokens` in it or the next step), every running request has a row in it,
        nothing waits and nothing is drafted. Pending aborts are then freed here, as `schedule()`
        would, and reported with the step returned, which is empty if it has no row. A row
        whose request `prev`'s token ends by its length is left out; one whose next position
        needs a block gets it here (no rows if the pool has none left: `schedule()` preempts as
        it must). A request that `prev`'s token stops (EOS, a stop token, a stop string) wastes
        its row here, which `update` drops.

        Blocks freed while `prev` or this step still writes a row of their old request may be
        handed out here or by the next `schedule()`. That is safe because the model runs steps
        one after another: the old row's write comes first, and the new owner writes each
        position before reading it. The old row writes past its request's full blocks, so no
        cached prefix block changes."""
        if self.waiting or self.proposer is not None or not prev.seqs:
            return None
        for seq in prev.seqs:
            sp = seq.sampling
            if (len(seq.token_ids) != 1 or not seq.sample or seq.history or seq.suppress
                    or seq.score_targets or sp.grammar is not None or sp.needs_history
                    or seq.output_index + 1 < sp.min_tokens):  # stop tokens held back next
                return None
        # NOTE: from here on, whatever the aborts free is reported, with rows or without.
        self._free_aborted()
        requests, running_status = self._requests, RequestStatus.RUNNING
        max_model_len, slots_per_block = self.config.max_model_len, self.kv.block_size
        rows: list[ScheduledSeq] = []
        rowed = 0  # running requests with a row in prev
        for seq in prev.seqs:
            sp = seq.sampling
            req = requests.get(seq.request_id)
            if req is None or req.status is not running_status:
                continue  # ended since (a stop string, a grammar cut): no row
            rowed += 1
            assert req.num_computed_tokens == seq.start_pos, seq.request_id
            pos, num_output = seq.start_pos + 1, seq.output_index + 1  # once prev's token is in
            if num_output >= sp.max_tokens or pos + 1 >= max_model_len:
                continue  # prev's token ends it by length
            if pos >= len(req.block_ids) * slots_per_block and not self.kv.allocate_slots(
                    req, 1, num_lookahead=1):
                rowed = -1  # no block left: `schedule` preempts as it must
                break
            rows.append(ScheduledSeq(seq.request_id, [PENDING_TOKEN], pos, req.block_ids, True,
                                     sp, num_output))
        if rowed != len(self.running):
            # A running request without a row in prev (a prompt the time target paced to
            # nothing, a budget smaller than the batch), or no block for a row: only
            # `schedule` decides.
            rows = []
        if not rows and not self._freed_ids:
            return None
        self.changes += 1
        self.stats.steps += bool(rows)
        # NOTE: with no rows, an empty step that only reports what the aborts freed.
        out = SchedulerOutput(seqs=rows, freed_ids=self._freed_ids, freed=self._freed,
                              inputs_pending=bool(rows))
        self._freed_ids, self._freed = [], []
        if self.debug_checks:
            self.check_integrity()
        return out

    def update(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[RequestUpdate]:
        """Apply a step's results: advance `num_computed_tokens`, register newly full blocks in the
        prefix cache, append sampled tokens and stop requests that are done (their blocks are
        freed at once). Output for a request finished or aborted meanwhile is dropped."""
        self.changes += 1
        ids, tokens = runner_out.request_ids, runner_out.token_ids
        # NOTE: a runner with logprobs off may leave the list empty.
        lps = runner_out.logprobs if runner_out.logprobs else [None] * len(tokens)
        if len(lps) != len(ids) or len(tokens) != len(ids):
            raise ValueError("the runner's request ids, tokens and logprobs differ in length")
        # One (token, logprob) per sampled row; a row with drafts may have several, in order.
        single: dict[str, tuple[int, TokenLogprobs | None]] = dict(zip(ids, zip(tokens, lps)))
        several: dict[str, list[tuple[int, TokenLogprobs | None]]] | None = None
        if len(single) != len(ids):
            several = {}
            for rid, token, lp in zip(ids, tokens, lps):
                several.setdefault(rid, []).append((token, lp))
        updates: list[RequestUpdate] = []
        now: float | None = None
        requests, aborts, stats = self._requests, self._pending_aborts, self.stats
        caching, slots_per_block = self.kv.enable_prefix_caching, self.kv.block_size
        window = self.kv.sliding_window is not None
        running_status, max_model_len = RequestStatus.RUNNING, self.config.max_model_len
        generated = 0  # sampled tokens kept, added to the stats once
        for seq in sched_out.seqs:
            rid = seq.request_id
            req = requests.get(rid)
            if req is None or req.status is not running_status or rid in aborts:
                continue
            start = seq.start_pos
            assert req.num_computed_tokens == start, (rid, start)
            if seq.draft_token_ids:
                kept = several[rid] if several is not None else [single[rid]]
                updates.append(self._update_speculative(req, seq, kept))
                continue
            num_new = len(seq.token_ids)
            computed = req.num_computed_tokens = start + num_new
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:
                stats.prompt_tokens_computed += min(computed, num_prompt) - start
            # NOTE: one more token fills a block only at a block's end. Blocks behind a sliding
            # window are released there too: at most one block's worth late.
            if (caching or window) and (num_new > 1 or computed % slots_per_block == 0):
                if caching:
                    self.kv.cache_full_blocks(req)
                if window:
                    self.kv.release_behind_window(req)
            if seq.score_targets:
                scores = runner_out.prompt_logprobs[rid]
                assert len(scores) == len(seq.score_targets), rid
                req.prompt_scores += scores
                req.num_prompt_scored += len(scores)
            if not seq.sample:
                continue
            if several is None:
                got = single.get(rid)
                assert got is not None, f"runner returned no token for {rid}"
                token, lp = got
            else:
                ((token, lp),) = several[rid]
            req.token_ids.append(token)
            generated += 1
            if req.first_token_time is None:
                now = self.clock() if now is None else now
                req.first_token_time = now
            status = stop_status(req, token, max_model_len)
            if status is not None:
                self._free(req, status)
            update = RequestUpdate(rid, [token], [lp], req.status)
            if req.sampling.prompt_logprobs is not None and req.num_output_tokens == 1:
                update.prompt_logprobs, req.prompt_scores = req.prompt_scores, []
            updates.append(update)
        stats.generated_tokens += generated
        if self.debug_checks:
            self.check_integrity()
        return updates

    def check_integrity(self) -> None:
        """Assert the scheduler's and the KV manager's invariants (cheap enough for tests)."""
        assert len(self.running) + len(self.waiting) == len(self._requests)
        assert len(self.running) <= self.config.max_num_seqs
        bs = self.kv.block_size
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, req.request_id
            assert self._requests.get(req.request_id) is req
            assert req.num_computed_tokens < req.num_tokens, req.request_id
            assert len(req.block_ids) >= -(-req.num_computed_tokens // bs), req.request_id
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING, req.request_id
            assert self._requests.get(req.request_id) is req
            assert not req.block_ids and req.num_computed_tokens == 0, req.request_id
        assert self.running == sorted(self.running, key=_running_key)
        assert self.waiting == sorted(self.waiting, key=_waiting_key)
        assert self.kv.holders() == {r.request_id for r in self.running}
        self.kv.check_integrity()

    def _chunk(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute for `req` this step: the rest of it, capped by the budget and, for a
        prefill, by `long_prefill_token_threshold`, so running streams keep getting tokens."""
        num_new = min(req.num_tokens - num_computed, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        if req.prompt_unscored:
            # Every scored position is a row of logits: bound the step's [rows, vocab].
            num_new = min(num_new, MAX_SCORED_CHUNK)
        assert num_new > 0, req.request_id
        return num_new

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Tokens to draft after a decode row's token (none when speculation is off, the request
        cannot take it, or the step's budget has no room)."""
        if self.proposer is None or not can_speculate(req.sampling, req.num_output_tokens):
            return []
        # The model's own token comes on top of the accepted drafts: never past max_tokens or
        # max_model_len.
        room = min(budget, req.sampling.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        return self.proposer.propose(req.token_ids, room) if room > 0 else []

    def _update_speculative(self, req: Request, seq: ScheduledSeq,
                            kept: list[tuple[int, TokenLogprobs | None]]) -> RequestUpdate:
        """Apply a row with drafts: `kept` is the accepted drafts then the model's own next
        token (`core/spec_verify`). Tokens are appended one by one and the first that stops the
        request ends it, as plain decoding would. KV is valid for the row's input token and the
        accepted drafts; the blocks reserved for rejected drafts go back to the pool, and they are
        never registered in the prefix cache (they hold no computed token)."""
        self.stats.spec_draft_tokens += len(seq.draft_token_ids)
        self.stats.spec_accepted_tokens += len(kept) - 1
        new_tokens: list[int] = []
        new_lps: list[TokenLogprobs | None] = []
        status = None
        for token, lp in kept:
            req.append_token(token)
            new_tokens.append(token)
            new_lps.append(lp)
            self.stats.generated_tokens += 1
            status = stop_status(req, token, self.config.max_model_len)
            if status is not None:
                break
        req.num_computed_tokens = min(seq.start_pos + len(kept), req.num_tokens - 1)
        self.kv.cache_full_blocks(req)
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        if status is not None:
            self._free(req, status)
        else:
            self.kv.trim(req)
            self.kv.release_behind_window(req)
        return RequestUpdate(req.request_id, new_tokens, new_lps, req.status)

    def _free_aborted(self) -> None:
        for request_id in self._pending_aborts:
            req = self._requests.get(request_id)
            if req is not None:
                self._free(req, RequestStatus.FINISHED_ABORTED)
        self._pending_aborts.clear()

    def _free(self, req: Request, status: RequestStatus) -> None:
        """The one exit: release the request's blocks and move it out of `running`/`waiting`.
        `status` WAITING means preemption: it goes back to the head of the queue to recompute
        prompt + output so far. Any other status finishes it and forgets it."""
        self.changes += 1
        self.kv.free(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._freed_ids.append(req.request_id)
        self._freed.append(req)
        if status is RequestStatus.WAITING:
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.stats.preemptions += 1
            bisect.insort(self.waiting, req, key=_waiting_key)
        else:
            req.status = status
            req.finished_time = self.clock()
            del self._requests[req.request_id]
