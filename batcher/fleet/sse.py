"""The stream side of a relay: pass SSE events through as they come, track what the client has
seen, mark resumed chunks, and end a broken stream explicitly (see `forward.py` for the
contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from batcher.fleet.forward import Failure, Relay

DONE = b"data: [DONE]\n\n"
SEP = b"\n\n"
# An error event the client caused (its own deadline) is its answer, not a replica failure.
CLIENT_ERROR_CODES = frozenset({"deadline_exceeded"})


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + SEP


async def relay_events(relay: Relay, buf: bytearray) -> tuple[bool, Failure | None]:
    """Write every complete event in `buf` to the client in one write (consuming them).
    Returns (saw [DONE], failure): a failure means the replica reported an error mid-stream;
    nothing of it was forwarded."""
    from batcher.fleet.forward import Failure

    out = bytearray()
    done, failure = False, None
    while not done and failure is None:
        end = buf.find(SEP)
        if end < 0:
            break
        ev = bytes(buf[:end])
        del buf[: end + 2]
        if not ev.startswith(b"data:"):
            out += ev + SEP  # comments and other fields pass through untouched
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
            if err.get("code") in CLIENT_ERROR_CODES or relay.rid in relay.ctx.cancelled:
                out += ev + SEP
                continue
            failure = Failure(f"the replica reported: {err.get('message')}")
            break
        out += sse(obj) if _track(relay, obj) else ev + SEP
    if out or done:
        await relay.write(bytes(out), eof=done)
    return done, failure


def _track(relay: Relay, obj: Any) -> bool:
    """Count and keep the chunk's text; True when the chunk was changed (resumed streams)."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices") or ()
    final = False
    changed = False
    prompt_ids = obj.get("prompt_token_ids")
    if isinstance(prompt_ids, list) and relay.prompt_ids is None:
        relay.prompt_ids = prompt_ids
    if relay.strip_ids and "prompt_token_ids" in obj:
        del obj["prompt_token_ids"]
        changed = True
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        i = ch.get("index", 0)
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            relay.ids.setdefault(i, []).extend(ids)
            if relay.strip_ids:
                del ch["token_ids"]
                changed = True
        if relay.chat:
            delta = ch.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = ch.get("text")
        if isinstance(text, str) and text:
            relay.sent += 1
            relay.texts.setdefault(i, []).append(text)
        if ch.get("finish_reason") is not None:
            relay.finished.add(i)
            final = True
    if not relay.resumed:
        return changed
    usage = obj.get("usage")
    if isinstance(usage, dict) and not choices:
        before = relay.sent_before_resume
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
        completion = int(usage.get("completion_tokens") or 0) + before
        usage.update(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
        final = True
    if final:
        obj["resumed"] = True
        obj["resumed_at"] = relay.sent_before_resume  # tokens streamed before it
    return final or changed


def resumable(relay: Relay) -> bool:
    """Only a completion with one prompt and one choice can continue elsewhere (the router has
    no chat template). With the prompt's token ids from the replica it continues token-exactly;
    else a text prompt continues with the streamed text appended."""
    b = relay.body
    prompt = b.get("prompt")
    one_text = isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                           and isinstance(prompt[0], str))
    return (b.get("failover") == "resume" and not relay.chat and relay.n == 1
            and (one_text or relay.prompt_ids is not None) and not b.get("echo"))


async def prepare_resume(relay: Relay) -> bool:
    """After a failure mid-stream: set up the resumed request and return True, or end the
    stream (explicit error, or the final chunk when nothing was left to generate) and return
    False."""
    reason = relay.last.reason if relay.last is not None else "the replica failed"
    if not resumable(relay):
        await end_with_error(relay, reason)
        return False
    body = dict(relay.body)
    if relay.strip_ids:
        body["return_token_ids"] = True
    max_tokens = body.get("max_tokens") or relay.ctx.cfg.policy.default_max_tokens
    done = relay.generated
    left = int(max_tokens) - done
    relay.resumed = True
    relay.sent_before_resume = done
    relay.ctx.metrics.failovers.labels("resume").inc()
    if left <= 0:  # every token was streamed; only the final chunk was lost
        final = {"id": f"cmpl-{relay.rid}", "object": "text_completion",
                 "model": body.get("model"), "resumed": True, "resumed_at": relay.sent,
                 "choices": [{"index": 0, "text": "", "logprobs": None,
                              "finish_reason": "length"}]}
        await relay.write(sse(final) + DONE, eof=True)
        return False
    if relay.prompt_ids is not None:
        # Exact: the new replica computes the very sequence the old one held.
        body["prompt"] = relay.prompt_ids + relay.ids.get(0, [])
        relay.prompt_ids = None  # the next replica reports the extended prompt
        relay.ids = {}
        relay.resume_offset = done
    else:
        prompt = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0]
        body["prompt"] = prompt + "".join(relay.texts.get(0, ()))
    body["max_tokens"] = left
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - done)
    relay.payload = orjson.dumps(body)
    return True


async def end_with_error(relay: Relay, reason: str) -> None:
    """The explicit end of a broken stream: an error event with what was sent, then [DONE]."""
    count = max([relay.n - 1, *relay.texts.keys()]) + 1
    err = {"error": {
        "message": f"the stream broke after {relay.generated} tokens and cannot continue: "
                   f"{reason}",
        "type": "service_unavailable", "param": None, "code": "upstream_failed",
        "tokens_sent": relay.generated,
        "partial_output": ["".join(relay.texts.get(i, ())) for i in range(count)]}}
    relay.ctx.metrics.failovers.labels("error").inc()
    relay.broke = True
    await relay.write(sse(err) + DONE, eof=True)
