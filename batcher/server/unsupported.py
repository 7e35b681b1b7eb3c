"""Request fields this server cannot honour: a 400 naming the field, never a silent 200.

A client that sends `response_format: json_schema` and gets free text back has a bug it cannot see;
a 400 tells it at once. Each entry says which values are harmless (the field's default, or a value
that asks for what we do anyway) and why any other value is refused. Fields that appear in neither
the OpenAI API nor the peers' extensions (vLLM, SGLang, llama.cpp's server) are ignored, as OpenAI's
own API ignores unknown fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batcher.http.errors import invalid


def _absent(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


@dataclass(frozen=True, slots=True)
class Unsupported:
    """`field` is accepted only when `harmless(value)`; otherwise a 400 that says `why`."""

    field: str
    why: str
    harmless: Callable[[Any], bool] = _absent


def _text_modalities(v: Any) -> bool:
    return v is None or v == ["text"]


def _no_tool_choice(v: Any) -> bool:
    return v is None or v == "none"


def _default_tier(v: Any) -> bool:
    return v is None or v in ("auto", "default")


STRUCTURED = ("this form of structured output is not supported; use 'response_format' or "
              "'guided_json', 'guided_regex', 'guided_choice', 'guided_grammar'")
TOOLS = "tool calling is a chat completions feature"

COMMON: tuple[Unsupported, ...] = (
    # The legacy form of tools; clients send `tools` since 2023.
    Unsupported("functions", "use 'tools'", _empty),
    Unsupported("function_call", "use 'tool_choice'", _no_tool_choice),
    Unsupported("audio", "audio output is not supported"),
    Unsupported("modalities", "only ['text']: audio output is not supported", _text_modalities),
    Unsupported("prediction", "predicted outputs are not supported"),
    Unsupported("web_search_options", "web search is not supported"),
    Unsupported("reasoning_effort", "the served model does not reason"),
    Unsupported("verbosity", "the served model has no verbosity setting"),
    Unsupported("store", "stored completions are not supported", _falsy),
    Unsupported("service_tier", "only 'auto' or 'default'", _default_tier),
    # vLLM's and SGLang's extensions for the same features.
    Unsupported("guided_decoding_backend", "one grammar engine serves every request"),
    Unsupported("structured_outputs", STRUCTURED),
    Unsupported("regex", STRUCTURED),
    Unsupported("json_schema", STRUCTURED),
    Unsupported("ebnf", STRUCTURED),
    Unsupported("use_beam_search", "beam search is not supported", _falsy),
    Unsupported("prompt_logprobs", "vLLM's prompt_logprobs field is not supported; on "
                "completions, 'echo' with 'logprobs' returns the prompt's logprobs"),
    Unsupported("include_stop_str_in_output", "stop strings are never included", _falsy),
    Unsupported("truncate_prompt_tokens", "prompts are never truncated"),
    Unsupported("bad_words", "bad words are not supported", _empty),
    Unsupported("allowed_token_ids", "allowed token ids are not supported", _empty),
    Unsupported("length_penalty", "length penalty applies to beam search, not supported"),
)
CHAT_ONLY: tuple[Unsupported, ...] = (
    Unsupported("echo", "chat echo is not supported", _falsy),
    Unsupported("chat_template", "a request-supplied chat template is not supported"),
    Unsupported("continue_final_message", "continuing the final message is not supported",
                _falsy),
    Unsupported("documents", "documents for the chat template are not supported", _empty),
)
COMPLETION_ONLY: tuple[Unsupported, ...] = (
    Unsupported("tools", TOOLS, _empty),
    Unsupported("tool_choice", f"only 'none': {TOOLS}", _no_tool_choice),
    Unsupported("parallel_tool_calls", TOOLS),
    Unsupported("suffix", "a suffix (insertion) is not supported", _empty),
)


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Raise ApiError(400) naming the first field this server cannot honour."""
    refuse_fields(body, (*COMMON, *(CHAT_ONLY if chat else COMPLETION_ONLY)))


def refuse_fields(body: dict[str, Any], rules: tuple[Unsupported, ...]) -> None:
    """Raise ApiError(400) naming the first field of `rules` whose value is not harmless."""
    for rule in rules:
        if rule.field in body and not rule.harmless(body[rule.field]):
            raise invalid(f"'{rule.field}' is not supported: {rule.why}", rule.field,
                          "unsupported")
