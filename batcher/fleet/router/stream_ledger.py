"""What a relayed stream has shown its client so far, and what follows from it: which events to
pass on, how many tokens were sent, the body of a resume elsewhere, the explicit end of a broken
stream. Pure bookkeeping (no I/O): `stream_relay.StreamRelay` does the writing (contract in
`forward.py`).

A broken stream ends in its route's own terms, so each API's client sees the failure: chat and
completions with an error chunk and `[DONE]`; Anthropic Messages with its `error` event; the
Responses API with `response.failed` (its `sequence_number` continuing the stream's, the
response object as `response.created` announced it, the items finished so far as its output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from batcher.fleet.router import batch_ids
from batcher.http import anthropic_errors
from batcher.http.errors import error_body
from batcher.http.sse import DONE, SEP, sse_event, sse_named

# An error event the client caused (its own deadline) is its answer, not a replica failure.
CLIENT_ERROR_CODES = frozenset({"deadline_exceeded"})
# Named events that end the Responses and Anthropic Messages streams (they send no [DONE]).
FINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete", b"response.failed",
                          b"message_stop", b"error"})
RESPONSES_PATH = "/v1/responses"


def _named_data(ev: bytes) -> Any:
    """The JSON of a named event's `data:` line, or None."""
    for line in ev.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                return orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                return None
    return None


@dataclass(slots=True)
class Taken:
    """The complete events of one read: `out` to write to the client, whether `[DONE]` came,
    and `failure` (the replica's error message) when it reported one mid-stream (not in `out`)."""

    out: bytes
    done: bool
    failure: str | None


@dataclass(slots=True)
class StreamLedger:
    chat: bool
    n: int  # choices the client expects
    # Token ids make a resume exact. The relay asks the replica for them; it strips them again
    # unless the client asked too.
    strip_ids: bool = False
    texts: dict[int, list[str]] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    sent: int = 0  # content chunks streamed (one token each, as the replica sends them)
    sent_before_resume: int = 0
    resumed: bool = False
    broke: bool = False  # ended with the explicit error event
    prompt_ids: list[int] | None = None
    resume_offset: int = 0  # tokens generated before the current attempt's prompt ids
    path: str = ""  # the route relayed: a broken stream ends in its API's terms
    # The Responses stream so far: the next sequence_number, the response object as
    # `response.created` announced it, and the output items finished.
    next_seq: int = 0
    response: dict[str, Any] | None = None
    items: list[Any] = field(default_factory=list)
    # The replica serving the attempt: a Responses stream's response objects carry ids that
    # name it (`responses_proxy.py`).
    owner: str | None = None

    @property
    def responses(self) -> bool:
        return self.path == RESPONSES_PATH

    @property
    def messages(self) -> bool:
        return self.path == anthropic_errors.PREFIX

    @property
    def generated(self) -> int:
        """Tokens streamed so far: exact when the replica sent ids, else content chunks."""
        if self.ids or self.resume_offset:
            return self.resume_offset + sum(len(v) for v in self.ids.values())
        return self.sent

    @property
    def complete(self) -> bool:
        """Every choice saw its finish reason."""
        return len(self.finished) >= self.n

    def take(self, buf: bytearray, cancelled: bool) -> Taken:
        """Consume every complete event in `buf`. `cancelled`: the client cancelled the request,
        so an error event is its answer and passes through."""
        out = bytearray()
        done, failure = False, None
        while not done and failure is None:
            end = buf.find(SEP)
            if end < 0:
                break
            ev = bytes(buf[:end])
            del buf[: end + 2]
            if not ev.startswith(b"data:"):
                name = ev[6:].split(b"\n", 1)[0].strip() if ev.startswith(b"event:") else None
                if self.responses or self.messages:
                    ev = self._track_named(ev, name)
                out += ev + SEP  # comments and other fields pass through untouched
                done = name in FINAL_EVENTS
                continue
            data = ev[5:].strip()
            if data == b"[DONE]":
                out += DONE
                done = True
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                out += ev + SEP
                continue
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict):
                if err.get("code") in CLIENT_ERROR_CODES or cancelled:
                    out += ev + SEP
                    continue
                failure = f"the replica reported: {err.get('message')}"
                break
            out += sse_event(obj) if self._track(obj) else ev + SEP
        return Taken(bytes(out), done, failure)

    def _track_named(self, ev: bytes, name: bytes | None) -> bytes:
        """Count the text a Responses or Messages event streamed; keep what `response.failed`
        needs. The event, with a response object's ids tagged with the owner replica."""
        obj = _named_data(ev)
        if not isinstance(obj, dict):
            return ev
        if self.owner is not None and isinstance(obj.get("response"), dict) and name:
            batch_ids.outward(obj["response"], self.owner, batch_ids.RESPONSE_ID_FIELDS)
            ev = sse_named(name.decode(errors="replace"), obj)[:-len(SEP)]
        seq = obj.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.next_seq = max(self.next_seq, seq + 1)
        kind = obj.get("type")
        if kind == "response.created" and isinstance(obj.get("response"), dict):
            self.response = obj["response"]
        elif kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
            self.items.append(obj["item"])
        elif kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            self.sent += 1
            self.texts.setdefault(0, []).append(obj["delta"])
        elif kind == "content_block_delta" and isinstance(obj.get("delta"), dict) and \
                isinstance(obj["delta"].get("text"), str):
            self.sent += 1
            self.texts.setdefault(0, []).append(obj["delta"]["text"])
        return ev

    def _track(self, obj: Any) -> bool:
        """Count and keep the chunk's text; True when the chunk was changed (ids stripped, or
        marked as resumed)."""
        if not isinstance(obj, dict):
            return False
        choices = obj.get("choices") or ()
        final = changed = False
        prompt_ids = obj.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_ids is None:
            self.prompt_ids = prompt_ids
        if self.strip_ids and "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
            changed = True
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            i = ch.get("index", 0)
            ids = ch.get("token_ids")
            if isinstance(ids, list):
                self.ids.setdefault(i, []).extend(ids)
                if self.strip_ids:
                    del ch["token_ids"]
                    changed = True
            if self.chat:
                delta = ch.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
            else:
                text = ch.get("text")
            if isinstance(text, str) and text:
                self.sent += 1
                self.texts.setdefault(i, []).append(text)
            if ch.get("finish_reason") is not None:
                self.finished.add(i)
                final = True
        if not self.resumed:
            return changed
        usage = obj.get("usage")
        if isinstance(usage, dict) and not choices:
            before = self.sent_before_resume
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
            completion = int(usage.get("completion_tokens") or 0) + before
            usage.update(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)
            final = True
        if final:
            obj["resumed"] = True
            obj["resumed_at"] = self.sent_before_resume  # tokens streamed before it
        return final or changed

    def resumable(self, body: dict[str, Any]) -> bool:
        """Only a completion with one prompt and one choice can continue elsewhere (the router
        has no chat template). With the prompt's token ids from the replica it continues
        token-exactly; else a text prompt continues with the streamed text appended."""
        prompt = body.get("prompt")
        one_text = isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                               and isinstance(prompt[0], str))
        return (body.get("failover") == "resume" and not self.chat and self.n == 1
                and (one_text or self.prompt_ids is not None) and not body.get("echo"))

    def resume(self, body: dict[str, Any], default_max_tokens: int, rid: str
               ) -> dict[str, Any] | bytes:
        """After a failure mid-stream of a `resumable` request: the body to send elsewhere, or
        (every token was streamed; only the final chunk was lost) the bytes that end the
        stream."""
        body = dict(body)
        if self.strip_ids:
            body["return_token_ids"] = True
        max_tokens = body.get("max_tokens") or default_max_tokens
        done = self.generated
        left = int(max_tokens) - done
        self.resumed = True
        self.sent_before_resume = done
        if left <= 0:
            final = {"id": f"cmpl-{rid}", "object": "text_completion",
                     "model": body.get("model"), "resumed": True, "resumed_at": self.sent,
                     "choices": [{"index": 0, "text": "", "logprobs": None,
                                  "finish_reason": "length"}]}
            return sse_event(final) + DONE
        if self.prompt_ids is not None:
            # Exact: the new replica computes the very sequence the old one held.
            body["prompt"] = self.prompt_ids + self.ids.get(0, [])
            self.prompt_ids = None  # the next replica reports the extended prompt
            self.ids = {}
            self.resume_offset = done
        else:
            prompt = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0]
            body["prompt"] = prompt + "".join(self.texts.get(0, ()))
        body["max_tokens"] = left
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - done)
        return body

    def broken(self, reason: str) -> bytes:
        """The explicit end of a broken stream, in the route's API: an error event with what
        was sent, then [DONE] (chat, completions); an `error` event (Messages); a
        `response.failed` event (Responses)."""
        message = (f"the stream broke after {self.generated} tokens and cannot continue: "
                   f"{reason}")
        self.broke = True
        if self.messages:
            return sse_named("error", anthropic_errors.error_body(503, message))
        if self.responses:
            return self._response_failed(message)
        count = max([self.n - 1, *self.texts.keys()]) + 1
        err = error_body(503, message, code="upstream_failed")
        err["error"].update(tokens_sent=self.generated, partial_output=[
            "".join(self.texts.get(i, ())) for i in range(count)])
        return sse_event(err) + DONE

    def _response_failed(self, message: str) -> bytes:
        resp = dict(self.response or {"object": "response", "output": []})
        resp.update(status="failed", output=list(self.items), usage=None,
                    error={"code": "server_error", "message": message})
        event = {"type": "response.failed", "sequence_number": self.next_seq, "response": resp}
        self.next_seq += 1
        return sse_named("response.failed", event)
