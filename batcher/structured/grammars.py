"""Structured outputs: turn a request's `response_format` (or vLLM's `guided_*` fields) into one
grammar string that the runtime's token masks enforce, and refuse a bad one with a ValueError
(HTTP 400) before the request is queued.

The grammar engine is llguidance. Measured on this CPU with the bundled tokenizer
(`python -m scripts.bench grammar`, a 3-field JSON schema walked token by token): compiling a schema
took ~2 ms against ~180-300 ms for outlines-core (which builds a whole token index per schema),
and a token mask ~9 us (median) against ~60 us. Its masks are computed on the CPU and applied as a
bitmask, so the same path serves CUDA rows (llguidance also ships a GPU kernel for applying them).
This module imports no torch, so the HTTP layer can validate with it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from batcher.structured.json_limits import loads_bounded

# A grammar may be large, but a schema of megabytes is a mistake or an attack.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256


# How an engine's error starts when it cut a request whose grammar cost too much per token
# (`batcher.runtime.grammar`): the server answers it as the request's fault (400), not the
# engine's.
GRAMMAR_TOO_COSTLY = "the grammar is too costly to follow"


@functools.cache
def grammar_limits() -> Any:
    """llguidance's resource limits, the same at request time and in the matcher: grammar size
    and the lexer's build fuel bound compiling (milliseconds); the Earley items a step may make
    bound one mask (a matcher over it is in error, which ends its request)."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=1_000_000,
                                     step_max_items=50_000, verbose_errors=False)


def _compiled(grammar: str, field: str) -> str:
    err = llguidance.LLMatcher.validate_grammar(grammar, None, limits=grammar_limits())
    if err:
        raise ValueError(f"'{field}' does not compile: {str(err)[:300]}")
    return grammar


def json_schema_grammar(schema: Any, field: str) -> str:
    if isinstance(schema, str):  # vLLM's `guided_json` may be the schema's JSON text
        try:
            schema = loads_bounded(schema)
        except ValueError as exc:
            raise ValueError(f"'{field}' is {'not valid JSON' if 'JSON' in str(exc) else exc}"
                             ) from None
    if not isinstance(schema, dict):
        raise ValueError(f"'{field}' must be a JSON schema object")  # noqa: TRY004 (a 400)
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"'{field}' is longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"'{field}' is not a usable JSON schema: {str(exc)[:300]}") from None
    return _compiled(grammar, field)


def regex_grammar(pattern: Any, field: str) -> str:
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"'{field}' must be a non-empty regular expression")
    try:
        grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"'{field}' is not a usable regular expression: {str(exc)[:300]}"
                         ) from None
    return _compiled(grammar, field)


def choice_grammar(choices: Any, field: str) -> str:
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"'{field}' must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return regex_grammar("|".join(f"({re.escape(c)})" for c in choices), field)


def lark_grammar(text: Any, field: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's) converted to it."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"'{field}' must be a non-empty grammar")
    try:
        if "::=" in text:
            text = gbnf_to_lark(text)
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except Exception as exc:  # noqa: BLE001 (the converter raises bare Exception; all are 400s)
        raise ValueError(f"'{field}' is not a usable grammar: {str(exc)[:300]}") from None
    return _compiled(grammar, field)


def response_format_grammar(fmt: Any) -> str | None:
    """OpenAI's `response_format`: None for text, else the grammar. ValueError if malformed."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("'response_format' must be an object with a 'type'")  # noqa: TRY004
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ValueError("'response_format.json_schema' must be an object with a 'schema'")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("'response_format.json_schema.strict' must be a boolean")
        # NOTE: strict or not, the answer is constrained to the schema: OpenAI's non-strict
        # mode only tries to follow it, and following it always is within that contract.
        return json_schema_grammar(spec.get("schema", {}), "response_format.json_schema.schema")
    raise ValueError("'response_format.type' must be 'text', 'json_object' or 'json_schema'")


# vLLM's request extensions, one grammar kind each.
GUIDED = {"guided_json": json_schema_grammar, "guided_regex": regex_grammar,
          "guided_choice": choice_grammar, "guided_grammar": lark_grammar}


def request_grammar(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """(grammar or None, the field it came from). At most one source may be given."""
    given = [k for k in ("response_format", *GUIDED) if body.get(k) is not None]
    if "response_format" in given and response_format_grammar(body["response_format"]) is None:
        given.remove("response_format")
    if len(given) > 1:
        raise ValueError(f"give at most one of {given}")
    if not given:
        return None, None
    field = given[0]
    if field == "response_format":
        return response_format_grammar(body[field]), field
    return GUIDED[field](body[field], field), field
