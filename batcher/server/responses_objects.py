"""The Responses API's response object and its output items, built from a chat answer; and
output items back as the chat messages a later turn continues from."""

from __future__ import annotations

from typing import Any

from batcher.server.bridge import new_id


def usage_body(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed"
            else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(rid: str, created: float, model: str, echo: dict[str, Any],
                    output: list[dict[str, Any]], finish: str | None,
                    usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
    """A response object. `finish` (the chat finish_reason) sets its status: "length" is
    `incomplete` for `max_output_tokens`, anything else `completed`."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": int(created), "status": status,
            "background": False, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "model": model, "output": output, "truncation": "disabled", **echo,
            "usage": usage_body(usage) if usage is not None else None}


def output_from_chat(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its reasoning, its text, then its calls."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs_"), message["reasoning_content"]))
    if message.get("content"):
        out.append(message_item(new_id("msg_"), message["content"]))
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        out.append(call_item(new_id("fc_"), call["id"], fn["name"], fn["arguments"]))
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn continues from."""
    msgs: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            msgs.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return msgs


def from_chat(answer: dict[str, Any], rid: str, echo: dict[str, Any]) -> dict[str, Any]:
    """A whole chat answer as a response object."""
    choice = answer["choices"][0]
    out = response_object(rid, answer["created"], answer["model"], echo,
                           output_from_chat(choice["message"]), choice["finish_reason"],
                           answer["usage"])
    if "timings" in answer:
        out["timings"] = answer["timings"]
    return out
