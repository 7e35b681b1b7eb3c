"""The rows a scheduler step hands the runner: one `ScheduledSeq` per request, built from the
request as it stands (pure functions of it)."""

from __future__ import annotations

from batcher.core.outputs import ScheduledSeq
from batcher.core.stopping import suppressed_tokens
from batcher.core.request import Request


def decode_row(req: Request) -> ScheduledSeq:
    """`scheduled_row(req, 1)` for a decode row (all but its last token computed): it samples,
    and it scores no prompt position (a row at the prompt's last position or later has none to
    score). The block table is the request's own list, not a copy: the KV manager never changes
    a list it handed out (`KVCacheManager.allocate_slots` grows a new one)."""
    ids = req.token_ids
    sp = req.sampling
    return ScheduledSeq(req.request_id, ids[-1:], len(ids) - 1, req.block_ids, True, sp,
                        len(ids) - len(req.prompt_token_ids),
                        suppressed_tokens(req) if sp.min_tokens else (),
                        tuple(ids) if sp.needs_history else ())


def scheduled_row(req: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledSeq:
    """The row a step computes for `req`: its next `num_new` tokens (and `drafts` after them),
    whether it samples, what it must not sample yet, and which prompt positions it scores."""
    start = req.num_computed_tokens
    seq = ScheduledSeq(
        request_id=req.request_id,
        token_ids=req.token_ids[start : start + num_new],
        start_pos=start,
        # NOTE: the request's own list: the KV manager grows a new one (see `decode_row`).
        block_ids=req.block_ids,
        sample=start + num_new == req.num_tokens,
        sampling=req.sampling,
        output_index=req.num_output_tokens,
        suppress=suppressed_tokens(req),
        history=tuple(req.token_ids) if req.sampling.needs_history and start + num_new
        == req.num_tokens else (),
    )
    if req.prompt_unscored:
        # Position p's logits score prompt token p + 1; earlier positions were scored
        # before a preemption (their entries are kept) or need no entry.
        lo = max(start, req.num_prompt_scored)
        hi = min(start + num_new, req.num_prompt_tokens - 1)
        if lo < hi:
            seq.score_targets = tuple(req.prompt_token_ids[lo + 1 : hi + 1])
            seq.score_offset = lo - start
    if drafts:
        seq.token_ids = seq.token_ids + drafts  # a new list: the request's stays as it is
        seq.draft_token_ids = tuple(drafts)
    return seq
