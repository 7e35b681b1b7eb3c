"""The `logprobs` of chat and completion answers: chat's per-token `content` list, the legacy
completions shape, and the legacy shape of an echoed prompt followed by its completion."""

from __future__ import annotations

from typing import Any

from batcher.core.outputs import TokenLogprobs
from batcher.tokenizer.tokenizer import Tokenizer


def chat_logprobs(tokenizer: Tokenizer, tokens: list[int], lps: list[TokenLogprobs | None]
                  ) -> dict[str, Any]:
    dec = tokenizer.decode
    # `bytes` are the token's own bytes: a piece of a multi-byte character decodes to
    # U+FFFD alone, and a client rebuilds the text from the bytes.
    raw = tokenizer.token_bytes
    content = []
    for t, lp in zip(tokens, lps):
        if lp is None:
            continue
        content.append({"token": dec([t]), "logprob": lp.logprob,
                        "bytes": list(raw(t)),
                        "top_logprobs": [{"token": dec([a]), "logprob": b,
                                          "bytes": list(raw(a))}
                                         for a, b in lp.top]})
    return {"content": content}


def legacy_logprobs(tokenizer: Tokenizer, tokens: list[int], lps: list[TokenLogprobs | None]
                    ) -> dict[str, Any]:
    dec = tokenizer.decode
    toks, token_lps, tops, offsets, off = [], [], [], [], 0
    for t, lp in zip(tokens, lps):
        tok = dec([t])
        toks.append(tok)
        offsets.append(off)
        off += len(tok)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {dec([a]): b for a, b in lp.top})
    return {"tokens": toks, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tokenizer: Tokenizer, prompt: list[int], scores: list[TokenLogprobs] | None,
                  then: dict[str, Any] | None = None) -> dict[str, Any]:
    """The legacy `logprobs` of an echoed prompt (its first token has none), followed by
    the completion's (`then`), offsets running on across both."""
    lps: list[TokenLogprobs | None] = [None, *(scores or [])]
    assert len(lps) == len(prompt), (len(lps), len(prompt))
    out = legacy_logprobs(tokenizer, prompt, lps)
    if then:
        base = out["text_offset"][-1] + len(out["tokens"][-1]) if prompt else 0
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += then[key]
        out["text_offset"] += [base + o for o in then["text_offset"]]
    return out
