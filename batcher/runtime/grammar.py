"""Token masks for rows that must follow a grammar (structured outputs), per row, off the critical
path.

One llguidance matcher per constrained request lives here, on the model thread. Each step,
`start` brings every constrained row's matcher up to the tokens sampled so far and hands the mask
computation to one helper thread, which fills a bitmask while the model step runs; `wait` then
gives the sampler the finished masks. Unconstrained rows cost nothing. The helper thread only
calls llguidance (Rust, no torch), so it never starts a second OpenMP team; the bitmask tensor is
made on the model thread and the helper writes through its pointer.

A matcher is rebuilt from the request's output tokens whenever it is missing or out of step (the
request was preempted and recomputed, or this is its first sample), so preemption and the prefix
cache need nothing else.

A grammar's cost is bounded. Building a matcher is bounded by llguidance's limits
(`batcher.structured.grammars.grammar_limits`, also checked when the request arrives); each step, a
row's mask and the consumption of its token are timed, and a request whose rows took more than
`ROW_BUDGET_S` over its last `BUDGET_STEPS` steps (a grammar so ambiguous that each token costs
milliseconds, which every other request in the step would wait for) is cut: `take_cut` names
it with the reason, and the engine ends it with that error. So a constrained request never adds
more than about `ROW_BUDGET_S` to the steps of the last `BUDGET_STEPS`, plus the one step that
crossed it (at most llguidance's per-step item limit: tens of milliseconds). The time is the
working thread's CPU time, not the wall clock's: a thread that waits (for the GIL through another
thread's garbage collection, or for a core on a busy machine) is not doing the grammar's work,
and a wall clock would cut an ordinary grammar for it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from batcher.core.outputs import ScheduledSeq
from batcher.structured.grammars import GRAMMAR_TOO_COSTLY, grammar_limits

# A constrained request may spend this much of the steps' time on its masks and token
# consumption over its last BUDGET_STEPS steps (2.5 ms a token on average; on the 2-core CPU a
# JSON schema of seven fields with nested objects, arrays, enums and patterns took at most
# 0.54 ms over any 8 tokens, and a regex of counted repeats, `[a-z]{20,40}( [a-z]{20,40}){3}`,
# whose lexer states are built as it goes, 3.5 ms). Every other request in the step waits for
# the masks, so this is what one constrained request may add to their steps; a tenant whose
# request is cut then cools down (`server/grammar_cooldown.py`). The first mask after a matcher is built is not
# counted: it builds the lexer's states, bounded by llguidance's fuel instead.
ROW_BUDGET_S = 0.020
BUDGET_STEPS = 8


class _Failed:
    """Stands in for a matcher that could not be built: it is always in error, so the row's
    mask allows only end of sequence."""

    def is_error(self) -> bool:
        return True

    def consume_token(self, token: int) -> bool:
        return False


_FAILED = _Failed()
log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Row:
    grammar: str
    matcher: Any  # llguidance.LLMatcher
    consumed: int  # output tokens the matcher has seen
    costs: deque[float] | None = None  # seconds per step, the last BUDGET_STEPS (after the first)
    counted: bool = False  # the first mask (building the lexer's states) has been seen

    def charge(self, seconds: float) -> float:
        """Add one step's cost; the total over the window."""
        if self.costs is None:
            self.costs = deque(maxlen=BUDGET_STEPS)
        self.costs.append(seconds)
        return sum(self.costs)


@dataclass(slots=True)
class StepMasks:
    """Masks of one step: `rows` index the sampling rows, `bitmask: [len(rows), words]` int32
    holds bit `t % 32` of word `t // 32` set when token t is allowed."""

    rows: list[int]
    bitmask: torch.Tensor
    seconds: list[float] | None = None  # each row's mask time


class GrammarMasks:
    """Matchers of the constrained requests in flight. Used from the model thread only."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ll: Any = None  # llguidance.LLTokenizer, built on first use (about a second)
        self._rows: dict[str, _Row] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._cut: dict[str, str] = {}  # requests over budget, with the reason

    def _lltokenizer(self) -> Any:
        # NOTE: building it reads the whole vocabulary (~1.4 s on this CPU), so the first
        # constrained request of a process waits that long once; it is kept on the tokenizer,
        # so every engine sharing that tokenizer reuses it.
        if self._ll is None:
            tok = self._tokenizer
            self._ll = getattr(tok, "_llguidance", None)
            if self._ll is None:
                # From the Rust tokenizer's JSON, as llguidance.hf does, but without importing
                # transformers (whose memory the server otherwise does without).
                backend = copy.copy(tok.hf.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=tok.vocab_size,
                                                  eos_token=list(tok.eos_token_ids))
                tok._llguidance = self._ll
        return self._ll

    def drop(self, request_ids: Sequence[str]) -> None:
        """Forget finished or preempted requests (a preempted one is rebuilt when it returns)."""
        for rid in request_ids:
            self._rows.pop(rid, None)

    def start(self, seqs: Sequence[ScheduledSeq]) -> Future[StepMasks] | None:
        """Begin the masks of this step's constrained sampling rows (`seqs` are the sampling
        rows in logit order); None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.grammar is not None]
        if not rows:
            return None
        matchers = [self._synced(seqs[i]) for i in rows]
        words = (self._lltokenizer().vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)  # made here, not in the helper
        ptr, stride = bitmask.data_ptr(), words * 4
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="batcher-grammar")

        def fill() -> StepMasks:
            seconds = [0.0] * len(matchers)
            for j, m in enumerate(matchers):
                if not m.is_error():
                    t0 = time.thread_time()
                    m.unsafe_compute_mask_ptr(ptr + j * stride, stride)
                    seconds[j] = time.thread_time() - t0
            return StepMasks(rows, bitmask, seconds)

        return self._pool.submit(fill)

    def wait(self, pending: Future[StepMasks], seqs: Sequence[ScheduledSeq]) -> StepMasks:
        """The step's masks once the helper is done. A matcher in error (see `advance`) allows
        only end of sequence."""
        masks = pending.result()
        for j, i in enumerate(masks.rows):
            row = self._rows.get(seqs[i].request_id)
            if row is not None and masks.seconds is not None:
                if row.counted:
                    self._charge(seqs[i].request_id, row, masks.seconds[j])
                row.counted = True
            if row is not None and row.matcher.is_error():
                self._note_limit(seqs[i].request_id, row)
                masks.bitmask[j].zero_()
                for t in self._tokenizer.eos_token_ids:
                    masks.bitmask[j, t // 32] |= 1 << (t % 32)
            elif seqs[i].sampling.ignore_eos:
                _ban_eos_unless_alone(masks.bitmask[j], self._tokenizer.eos_token_ids)
        return masks

    def advance(self, seqs: Sequence[ScheduledSeq], tokens: Sequence[int]) -> None:
        """Feed each constrained row its sampled token."""
        for s, t in zip(seqs, tokens, strict=True):
            row = self._rows.get(s.request_id) if s.sampling.grammar is not None else None
            if row is None:
                continue
            # A token outside the grammar (only possible when every allowed token was banned,
            # e.g. EOS under min_tokens) leaves the matcher in error: its masks then allow only
            # end of sequence, so the answer ends rather than run on unconstrained.
            t0 = time.thread_time()
            row.matcher.consume_token(t)
            row.consumed += 1
            if row.costs is not None:
                self._charge(s.request_id, row, time.thread_time() - t0, same_step=True)

    def _charge(self, request_id: str, row: _Row, seconds: float, same_step: bool = False
                ) -> None:
        if same_step and row.costs:
            row.costs[-1] += seconds
            total = sum(row.costs)
        else:
            total = row.charge(seconds)
        if total > ROW_BUDGET_S and request_id not in self._cut:
            self._cut[request_id] = (
                f"{GRAMMAR_TOO_COSTLY}: its masks took {total * 1000:.0f} ms over "
                f"{len(row.costs or ())} tokens, over the {ROW_BUDGET_S * 1000:.0f} ms this "
                f"server allows per {BUDGET_STEPS} tokens; use a less ambiguous grammar")
            row.matcher = _FAILED  # no more work for it; the engine ends the request

    def _note_limit(self, request_id: str, row: _Row) -> None:
        """A matcher that ran into llguidance's per-step limits ends its request with that
        error (other errors, a token outside the grammar, end it as it stands)."""
        if row.matcher is _FAILED or request_id in self._cut:
            return
        err = str(row.matcher.get_error() or "")
        if "limit" in err.lower():
            self._cut[request_id] = f"{GRAMMAR_TOO_COSTLY}: {err.splitlines()[0][:200]}"

    def take_cut(self) -> dict[str, str]:
        """Requests whose grammar went over its budget since the last call, with the reason
        (the engine ends each with that error)."""
        cut, self._cut = self._cut, {}
        for rid in cut:
            self._rows.pop(rid, None)
        return cut

    def _synced(self, s: ScheduledSeq) -> Any:
        grammar = s.sampling.grammar
        assert grammar is not None
        row = self._rows.get(s.request_id)
        if row is None or row.consumed != s.output_index or row.grammar != grammar:
            made = s.history[len(s.history) - s.output_index:] if s.output_index else ()
            try:
                m = llguidance.LLMatcher(self._lltokenizer(), grammar, limits=grammar_limits())
                if made:
                    m.consume_tokens(list(made))
            except Exception:  # one request's grammar must never fail the step
                log.exception("grammar matcher failed for %s", s.request_id)
                m = _FAILED
            row = self._rows[s.request_id] = _Row(grammar, m, s.output_index)
        return row.matcher

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _ban_eos_unless_alone(words: torch.Tensor, eos_ids: Sequence[int]) -> None:
    """`ignore_eos` on a constrained row: its grammar may end the output here, but the caller
    asked for more, so end of sequence is banned while the grammar allows any other token. Once
    it allows nothing else, the output is complete and end of sequence ends it (a grammar row
    stops on EOS even under `ignore_eos`, see `core/stopping.py`)."""
    saved = [(t, int(words[t // 32]) >> (t % 32) & 1) for t in eos_ids if t // 32 < len(words)]
    for t, _ in saved:
        words[t // 32] &= ~(1 << (t % 32))
    if not bool(words.any()):
        for t, bit in saved:
            if bit:
                words[t // 32] |= 1 << (t % 32)


def apply_masks(logits: torch.Tensor, masks: StepMasks) -> torch.Tensor:
    """`logits: [n, vocab]` with every disallowed token of the masked rows at -inf (in place)."""
    n_rows, words = masks.bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((masks.bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(n_rows, words * 32)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # model rows past the tokenizer's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device)
    idx = torch.tensor(masks.rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
