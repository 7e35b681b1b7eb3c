"""Request schemas of the OpenAI completion and chat APIs: parse and validate a JSON body into a
`GenerationSpec` (anything wrong -> ApiError 400 naming the field), and shape responses."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import bool_field, invalid
from batcher.core.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from batcher.server.tool_parsers import ToolParser, ToolSpec, get_parser, parse_tools
from batcher.server.unsupported import refuse_unsupported
from batcher.structured.grammars import GUIDED, request_grammar
from batcher.admission.tenants import PRIORITY_NAMES

MAX_N = 16
MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64
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
    echo: bool = False  # completions: the prompt's text leads each choice's text
    # Completions with `max_tokens: 0` and `echo`: the prompt alone is the answer (scoring a
    # text, with `logprobs`). The engine samples one token, which is dropped.
    score_only: bool = False
    tools: ToolSpec = field(default_factory=ToolSpec)  # chat: tools the answer may call
    chat_tools: list[dict[str, Any]] | None = None  # what the chat template receives as `tools`
    template_kwargs: dict[str, Any] | None = None  # chat: `chat_template_kwargs`
    timeout: float | None = None
    # Extension: each choice carries its token ids (and the first stream chunk the prompt's),
    # so a router can resume a broken stream elsewhere token-exactly.
    return_token_ids: bool = False


# What the chat template's caller sets itself: a request may not override them.
_TEMPLATE_OWN = frozenset({"messages", "conversation", "tools", "documents",
                           "add_generation_prompt", "tokenize", "chat_template"})


def _template_kwargs(body: dict) -> dict[str, Any] | None:
    """`chat_template_kwargs`: variables for the chat template (`{"enable_thinking": false}`),
    as vLLM and SGLang take them."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs",
                      "invalid_type")
    own = sorted(k for k in v if k in _TEMPLATE_OWN)
    if own:
        raise invalid(f"'chat_template_kwargs' may not set {own[0]!r}", "chat_template_kwargs")
    return v or None


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


def _priority(body: dict) -> str:
    """A named class, or an integer as vLLM and SGLang clients send (lower is more urgent,
    0 the default): 0 and below run as `interactive`, above 0 as `batch`."""
    v = body.get("priority")
    if isinstance(v, int) and not isinstance(v, bool):
        if not -(1 << 31) <= v < (1 << 31):
            raise invalid("an integer 'priority' must fit in 32 bits", "priority")
        return "interactive" if v <= 0 else "batch"
    return _choice(body, "priority", PRIORITY_NAMES)


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                          for x in v):
        raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids",
                      "invalid_type")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids",
                      "stop_token_ids")
    if any(not 0 <= x < vocab_size for x in v):
        raise invalid(f"stop token ids must be in [0, {vocab_size})", "stop_token_ids")
    return list(dict.fromkeys(v))


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's shape: token ids as JSON object keys (strings), biases in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        # NOTE: at most 12 digits: int() of thousands of digits is slow, and over 4,300 a
        # ValueError (a 500).
        tid = (int(key) if isinstance(key, str) and len(key) <= 12 and key.isascii()
               and key.isdigit() else -1)
        if not 0 <= tid < vocab_size:
            raise invalid(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got "
                          f"{str(key)[:32]!r}", "logit_bias")
        out[tid] = _num({"logit_bias": bias}, "logit_bias", 0.0, -100.0, 100.0) or 0.0
    return out


def parse_generation(body: Any, chat: bool, served_models: set[str], vocab_size: int,
                     tool_parser: ToolParser | None = None) -> GenerationSpec:
    """Validate a completion (`chat=False`) or chat body. Raises ApiError(400). `model` may be
    left out when exactly one model is served, as vLLM and llama.cpp's server allow.
    `tool_parser`: the served model's tool-call format (the generic one by default)."""
    tool_parser = tool_parser or get_parser("generic")
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    refuse_unsupported(body, chat)
    model = body.get("model")
    if model is None and len(served_models) == 1:
        model = next(iter(served_models))
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
        spec.tools = parse_tools(body)
        spec.messages = tool_parser.render(msgs, spec.tools)
        spec.chat_tools = tool_parser.template_tools(spec.tools)
        spec.template_kwargs = _template_kwargs(body)
        lp = bool_field(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not lp:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        spec.logprobs = (top or 0) if lp else None
    else:
        spec.prompts = _prompts(body, vocab_size)
        spec.logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        spec.echo = bool_field(body, "echo", False)
        best_of = _int(body, "best_of", None, 1, MAX_N)
        if best_of is not None and best_of != (_int(body, "n", 1, 1, MAX_N) or 1):
            raise invalid("'best_of' other than 'n' is not supported", "best_of", "unsupported")
    mt = body.get("max_completion_tokens") if chat else None
    key = "max_completion_tokens" if mt is not None else "max_tokens"
    max_tokens = _int(body, key, None, 0 if spec.echo else 1, 1 << 20)
    spec.max_tokens_given = max_tokens is not None
    if max_tokens == 0:
        # NOTE: one token is sampled from logits the last prompt row computes anyway: no
        # extra model work, and every engine path stays the same.
        spec.score_only, max_tokens = True, 1
    spec.n = _int(body, "n", 1, 1, MAX_N) or 1
    spec.stream = bool_field(body, "stream", False)
    spec.return_token_ids = bool_field(body, "return_token_ids", False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
        spec.include_usage = bool_field(so, "include_usage", False)
    spec.priority = _priority(body)
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
        seed=seed, stop=_stop(body), ignore_eos=bool_field(body, "ignore_eos", False),
        logprobs=spec.logprobs, prompt_logprobs=spec.logprobs if spec.echo else None,
        min_tokens=_int(body, "min_tokens", 0, 0, 1 << 20) or 0,
        stop_token_ids=_stop_token_ids(body, vocab_size),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0) or 0.0,
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0) or 0.0,
        repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.01, 10.0) or 1.0,
        logit_bias=_logit_bias(body, vocab_size),
        min_p=_num(body, "min_p", 0.0, 0.0, 1.0) or 0.0)
    try:
        spec.sampling.grammar, _ = request_grammar(body)
    except ValueError as exc:
        field = next((k for k in ("response_format", *GUIDED) if body.get(k) is not None),
                     "response_format")
        raise invalid(str(exc), field) from None
    calls = tool_parser.grammar(spec.tools)
    if calls is not None:
        if spec.sampling.grammar is not None:
            raise invalid("a tool call and a structured output cannot both constrain one answer"
                          "; use tool_choice 'none'", "tool_choice")
        spec.sampling.grammar = calls
    return spec


def now_s() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
