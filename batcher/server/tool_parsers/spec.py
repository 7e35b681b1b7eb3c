"""The request's tools: `tools`, `tool_choice` and `parallel_tool_calls`, validated."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from batcher.http.errors import invalid
from batcher.structured.json_limits import loads_bounded

MAX_TOOLS = 64
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(slots=True)
class ToolSpec:
    """The request's tools and how the answer may use them."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # the `function` objects
    choice: str = "auto"  # auto | required | none | the name of one tool
    parallel: bool = True  # several calls in one answer (OpenAI's default)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The answer must be a call."""
        return self.active and self.choice != "auto"

    @property
    def offered(self) -> list[dict[str, Any]]:
        """The tools the answer may call: all of them, or the one named by `tool_choice`."""
        if not self.active:
            return []
        if self.choice in ("auto", "required"):
            return self.tools
        return [t for t in self.tools if t["name"] == self.choice]

    @property
    def many(self) -> bool:
        """Whether one answer may hold several calls (a named choice is one call)."""
        return self.parallel and self.choice in ("auto", "required")


def parse_tools(body: dict[str, Any]) -> ToolSpec:
    """`tools`, `tool_choice`, `parallel_tool_calls`. Raises ApiError(400) naming the field."""
    raw = body.get("tools")
    spec = ToolSpec()
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools",
                          "invalid_type")
        names = set()
        for i, t in enumerate(raw):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                              "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
                raise invalid(f"tools[{i}].function.name must be a unique name of 1-64 letters, "
                              "digits, '_' or '-'", "tools")
            params = fn.get("parameters", {"type": "object"})
            if not isinstance(params, dict):
                raise invalid(f"tools[{i}].function.parameters must be a JSON schema", "tools")
            desc = fn.get("description", "")
            if not isinstance(desc, str):
                raise invalid(f"tools[{i}].function.description must be a string", "tools")
            names.add(name)
            spec.tools.append({"name": name, "description": desc, "parameters": params})
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        spec.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        spec.choice = choice["function"]["name"]
        if spec.choice not in {t["name"] for t in spec.tools}:
            raise invalid(f"tool_choice names '{spec.choice[:64]}', which is not among 'tools'",
                          "tool_choice")
    else:
        raise invalid("'tool_choice' must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if spec.choice == "required" and not spec.tools:
        raise invalid("tool_choice 'required' needs 'tools'", "tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls",
                      "invalid_type")
    spec.parallel = ptc is not False
    return spec


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains",
               "additionalProperties", "unevaluatedProperties", "propertyNames")


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that names its
    properties and says nothing of others, as strict tool schemas are: decoding a call's
    arguments then ends at the keys the tool names, instead of inventing more until
    `max_tokens`. A schema that asks for other keys (any `additionalProperties`) keeps them;
    branches of an `allOf` stay open (each would refuse the other's keys). A copy; the tool
    as the client gave it is what the model is shown."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(v, in_all_of=True) for v in out["allOf"]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("items"), list):  # the older tuple form
        out["items"] = [closed_objects(v) for v in out["items"]]
    names_keys = isinstance(out.get("properties"), dict) and out["properties"]
    if (names_keys and not in_all_of and "allOf" not in out
            and "additionalProperties" not in out and "patternProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape; `arguments` as the JSON text clients parse."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def call_arguments(calls: Any, i: int) -> list[tuple[str, Any]]:
    """An assistant message's earlier `tool_calls` as (name, arguments object) pairs. Raises
    ApiError(400) naming `messages` on a malformed one."""
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"messages[{i}].tool_calls items need function.name", "messages")
        args = fn.get("arguments", "{}")
        try:
            parsed = loads_bounded(args) if isinstance(args, str) else args
        except ValueError:
            raise invalid(f"messages[{i}].tool_calls arguments must be JSON", "messages"
                          ) from None
        out.append((fn["name"], parsed))
    return out
