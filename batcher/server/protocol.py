"""Request schemas of the OpenAI completion and chat APIs: parse and validate a JSON body into a
`GenerationSpec` (anything wrong -> ApiError 400 naming the field), and shape responses."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import invalid
from batcher.sampling import MAX_TOP_LOGPROBS, SamplingParams
from batcher.tenants import PRIORITY_NAMES

MAX_N = 16
MAX_STOP = 4
FAILOVER = ("error", "resume")


@dataclass(slots=True)
class GenerationSpec:
    """A validated completion or chat request, before tokenization."""

    chat: bool
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[Any] | None = None  # chat
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_given: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # number of top alternatives; None = off
    priority: str = "interactive"
    timeout: float | None = None
    # Extension: each choice carries its token ids (and the first stream chunk the prompt's),
    # so a router can resume a broken stream elsewhere token-exactly.
    return_token_ids: bool = False


def _num(body: dict, key: str, default: float | None, lo: float, hi: float) -> float | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"'{key}' must be a number", key, "invalid_type")
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo:g} and {hi:g}, got {v:g}", key)
    return float(v)


def _int(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{key}' must be an integer", key, "invalid_type")
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _choice(body: dict, key: str, options: tuple[str, ...]) -> str:
    v = body.get(key)
    if v is None:
        return options[0]
    if v not in options:
        raise invalid(f"'{key}' must be one of {list(options)}", key)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop",
                      "invalid_type")
    if len(items) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} strings", "stop")
    return items


def _prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [_token_list(p, vocab_size)]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [_token_list(x, vocab_size) for x in p]
    raise invalid("'prompt' must be a string, a list of strings, or a list of token ids",
                  "prompt", "invalid_type")


def _token_list(ids: list, vocab_size: int) -> list[int]:
    if not ids or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise invalid("token id prompts must be non-empty lists of integers", "prompt",
                      "invalid_type")
    if any(not 0 <= x < vocab_size for x in ids):
        raise invalid(f"token ids must be in [0, {vocab_size})", "prompt")
    return ids


def parse_generation(body: Any, chat: bool, served_models: set[str], vocab_size: int
                     ) -> GenerationSpec:
    """Validate a completion (`chat=False`) or chat body. Raises ApiError(400)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model", "missing")
    if model not in served_models:
        # Quote at most 64 characters of it: an echo of a 1 MiB name helps nobody.
        raise invalid(f"model '{model[:64]}' is not served here; available: "
                      f"{sorted(served_models)}",
                      "model", "model_not_found")
    spec = GenerationSpec(chat=chat, model=model)
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise invalid("'messages' must be a non-empty list", "messages", "invalid_type")
        spec.messages = msgs
        lp = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not lp:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        spec.logprobs = (top or 0) if lp else None
    else:
        spec.prompts = _prompts(body, vocab_size)
        spec.logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        if _bool(body, "echo", False):
            raise invalid("'echo' is not supported", "echo", "unsupported")
    mt = body.get("max_completion_tokens") if chat else None
    key = "max_completion_tokens" if mt is not None else "max_tokens"
    max_tokens = _int(body, key, None, 1, 1 << 20)
    spec.max_tokens_given = max_tokens is not None
    spec.n = _int(body, "n", 1, 1, MAX_N) or 1
    spec.stream = _bool(body, "stream", False)
    spec.return_token_ids = _bool(body, "return_token_ids", False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
        spec.include_usage = _bool(so, "include_usage", False)
    spec.priority = _choice(body, "priority", PRIORITY_NAMES)
    # Validated for the router, which reads it; a replica has nothing to fail over to.
    _choice(body, "failover", FAILOVER)
    spec.timeout = _num(body, "timeout", None, 0.001, 86400.0)
    user = body.get("user")  # accepted as OpenAI's API does; not used
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user", "invalid_type")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("'seed' must be an integer", "seed", "invalid_type")
    top_k = _int(body, "top_k", 0, -1, 1 << 20)
    spec.sampling = SamplingParams(
        max_tokens=max_tokens or 16,
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        top_k=max(0, top_k or 0),
        seed=seed, stop=_stop(body), ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=spec.logprobs, min_tokens=_int(body, "min_tokens", 0, 0, 1 << 20) or 0)
    for key in ("presence_penalty", "frequency_penalty"):
        if _num(body, key, 0.0, -2.0, 2.0):
            raise invalid(f"'{key}' is not supported (only 0)", key, "unsupported")
    if body.get("tools") or body.get("functions"):
        raise invalid("tool calling is not supported", "tools", "unsupported")
    return spec


def now_s() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
