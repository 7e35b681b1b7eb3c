"""What the router reads of a generation request's body: its token estimates and its prefix
affinity key, never its meaning (the replica validates).

- `estimate_tokens(body, chat)`: prompt characters / 4 (or the token count of a token-id prompt)
  plus `max_tokens`, times `n`; `estimate_prompt_tokens` is the prompt part alone. A Responses
  body is read through `responses_as_chat` (its `instructions` and `input` as messages,
  `max_output_tokens` as `max_tokens`), so its prompt size and prefix affinity count too.
- `affinity_key(body, chat)`: the prompt's leading text, which `policy.choose` hashes to a
  preferred replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from batcher.fleet.router.policy import PolicyConfig


def responses_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses body (`/v1/responses`) as the chat fields the estimates read: `instructions`
    and `input` (a string, or message, function_call and function_call_output items) as
    `messages`, `max_output_tokens` as `max_tokens`. An `input` of another shape gives no
    messages, so the request goes to a replica as it is (whose 400 names the field)."""
    messages: list[dict[str, Any]] | None = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                messages = None
                break
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"), "content": item.get("content")})
            elif kind == "function_call":
                messages.append({"role": "assistant", "content": item.get("arguments")})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": item.get("output")})
    else:
        messages = None
    out: dict[str, Any] = {"messages": messages}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def estimate_prompt_tokens(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> int:
    """The prompt tokens one request brings to prefill (an estimate, never below 1)."""
    out = _default_out(body, chat, cfg)
    n = body.get("n") or 1
    n = n if isinstance(n, int) and n > 0 else 1
    return max(1, estimate_tokens(body, chat, cfg) // n - out)


def _default_out(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> int:
    if chat:
        out = (body.get("max_completion_tokens") or body.get("max_tokens")
               or cfg.default_chat_max_tokens)
    else:
        out = body.get("max_tokens") or cfg.default_max_tokens
    return out if isinstance(out, int) and out > 0 else cfg.default_max_tokens


def estimate_tokens(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> int:
    """Prompt + output tokens one request may hold in KV (an estimate, never below 1)."""
    prompt = 0.0
    if chat:
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            prompt += len(content) / cfg.chars_per_token + 4 if isinstance(content, str) else 4
        default = cfg.default_chat_max_tokens
        out = body.get("max_completion_tokens") or body.get("max_tokens") or default
    else:
        p = body.get("prompt")
        items = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        for item in items:
            if isinstance(item, str):
                prompt += len(item) / cfg.chars_per_token
            elif isinstance(item, list):
                prompt += len(item)
        out = body.get("max_tokens") or cfg.default_max_tokens
    n = body.get("n") or 1
    out = out if isinstance(out, int) and out > 0 else cfg.default_max_tokens
    n = n if isinstance(n, int) and n > 0 else 1
    return max(1, math.ceil(prompt) + out) * n


def affinity_key(body: Mapping[str, Any], chat: bool, cfg: PolicyConfig) -> str | None:
    """The prompt's leading text, or None when affinity is off or the prompt is short."""
    if cfg.affinity_chars <= 0:
        return None
    if chat:
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                parts.append(f"{m.get('role')}:{m['content']}")
        text = "\n".join(parts)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list):  # token ids: about chars_per_token characters each
            text = ",".join(map(str, p[: int(cfg.affinity_chars / cfg.chars_per_token)]))
        else:
            text = p if isinstance(p, str) else ""
    if len(text) < cfg.affinity_min_chars:
        return None
    return text[: cfg.affinity_chars]


def well_formed(body: dict[str, Any], chat: bool) -> bool:
    """Whether the prompt has a shape the routing estimates can read. Anything else goes to a
    replica as it is, and the replica's 400 (naming the field) is the answer."""
    if chat:
        msgs = body.get("messages")
        return isinstance(msgs, list) and all(
            isinstance(m, dict) and (isinstance(m.get("content"), str | None) or (
                isinstance(m.get("content"), list) and all(
                    isinstance(p, dict) and isinstance(p.get("text", ""), str)
                    for p in m["content"]))) for m in msgs)
    p = body.get("prompt")
    return isinstance(p, str) or (isinstance(p, list) and (
        all(isinstance(x, int) for x in p) or all(isinstance(x, str) for x in p)
        or all(isinstance(x, list) for x in p)))


def choices_count(body: dict[str, Any], chat: bool) -> int:
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)
    return n
