"""When a request stops: its stop tokens, the tokens held back until `min_tokens`, and its length
limits. Pure functions of the request, shared by plain and speculative decoding."""

from __future__ import annotations

from batcher.core.request import Request, RequestStatus


def suppressed_tokens(req: Request) -> tuple[int, ...]:
    """Token ids the sampler must not pick yet: EOS (unless ignored, which a grammar overrides)
    and stop token ids while fewer than `min_tokens` were generated."""
    sp = req.sampling
    if req.num_output_tokens >= sp.min_tokens:
        return ()
    # A grammar row stops on EOS even under ignore_eos (see stop_status), so it is held back too.
    eos = () if sp.ignore_eos and sp.grammar is None else req.eos_token_ids
    return tuple(eos) + tuple(sp.stop_token_ids)


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """FINISHED_STOPPED on EOS (unless ignore_eos, which a grammar overrides) or a stop token id, once more than
    `min_tokens` were generated; else FINISHED_LENGTH at max_tokens or max_model_len; None to go
    on. NOTE: a stop token that is also the last allowed one reports "stop", the truer reason.
    The sampler is expected to mask stop tokens below `min_tokens`; if it does not, such a token
    is kept as an ordinary one."""
    # NOTE: called for every sampled token: locals, not the request's properties, and the
    # membership tests first, since most tokens are neither EOS nor a stop token.
    sp = req.sampling
    num_tokens = len(req.token_ids)
    num_output = num_tokens - len(req.prompt_token_ids)
    # NOTE: a constrained row stops on EOS even under ignore_eos: its grammar offers EOS alone
    # only once the output is complete (runtime/grammar.py bans it while anything else is
    # allowed), and nothing but EOS could follow it.
    if ((token in req.eos_token_ids and (not sp.ignore_eos or sp.grammar is not None))
            or token in sp.stop_token_ids) and num_output > sp.min_tokens:
        return RequestStatus.FINISHED_STOPPED
    if num_output >= sp.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
