"""POST /tokenize and /detokenize in vLLM's shapes, and GET /v1/models listing every served model
with the routes it serves.

`/tokenize` takes `prompt` (a string; `add_special_tokens` defaults to true, as a completion's
prompt is encoded) or `messages` (rendered by the chat template exactly as a chat request is;
`add_generation_prompt` defaults to true) and answers `{"count", "max_model_len", "tokens"}`, plus
`token_strs` when `return_token_strs` is true. A text that does not fit the model's context is
refused (400 `context_length_exceeded`), before tokenizing when its length alone says so: the
answer is bounded by the context. `/detokenize` takes `tokens` and answers
`{"prompt"}`. `model` is optional, as on the generation routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from batcher.http.errors import ApiError, bool_field, invalid
from batcher.http.listener import read_json
from batcher.http.responses import json_response
from batcher.server.appkeys import GATEWAY
from batcher.server.gateway import TOKENIZE_OFFLOAD_CHARS, Gateway
from batcher.admission.tenants import TenantConfig
from batcher.tokenizer.tokenizer import message_chars

GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
EMBEDDING_ROUTES = ["/v1/embeddings"]
# More ids than any context holds is a mistake, not a prompt.
MAX_DETOKENIZE_IDS = 1 << 20


def _body(raw: Any, gw: Gateway) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_type")
    model = raw.get("model")
    if model is not None and model != gw.cfg.model_name:
        if isinstance(model, str) and model == gw.embedder_name:
            raise invalid(f"model '{model}' is an embedding model; tokenize with the generative "
                          f"model '{gw.cfg.model_name}'", "model", "model_not_found")
        raise invalid(f"model '{str(model)[:64]}' is not served here; available: "
                      f"['{gw.cfg.model_name}']", "model", "model_not_found")
    return raw


async def _off_loop(size: int, work: Callable[[], Any], gw: Gateway | None = None,
                    tenant: TenantConfig | None = None) -> Any:
    """Run long tokenizer work in a thread so the event loop keeps answering (no torch here),
    counted against the tenant's concurrency when one is given."""
    if size > TOKENIZE_OFFLOAD_CHARS:
        if gw is not None:
            return await gw.off_loop(tenant, work)
        return await asyncio.get_running_loop().run_in_executor(None, work)
    return work()


def _check_fits(gw: Gateway, chars: int) -> None:
    """A text longer than any context holds is refused before it is tokenized (seconds of CPU
    for megabytes), and so is one whose tokens do not fit: that bounds the answer too."""
    limit = gw.cfg.max_model_len
    if gw.tokenizer.min_tokens(chars) > limit:
        raise ApiError(400, f"this model's context is {limit} tokens; a text of {chars} "
                       "characters cannot fit in it", param="prompt",
                       code="context_length_exceeded")


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        return await _tokenize(request, gw)
    except ApiError as err:
        gw.note_refusal(request, err)
        raise


async def _tokenize(request: web.Request, gw: Gateway) -> web.Response:
    tenant = request.get("tenant")
    body = _body(await gw.read_request(request), gw)
    tok = gw.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise invalid("give exactly one of 'prompt' or 'messages'", "prompt", "invalid_type")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid("'prompt' must be a string", "prompt", "invalid_type")
        special = bool_field(body, "add_special_tokens", True)
        strs = bool_field(body, "return_token_strs", False)
        _check_fits(gw, len(prompt))
        ids = await _off_loop(len(prompt), lambda: tok.encode(prompt, special), gw, tenant)
    else:
        messages = body["messages"]
        gen = bool_field(body, "add_generation_prompt", True)
        strs = bool_field(body, "return_token_strs", False)
        _check_fits(gw, message_chars(messages))
        try:
            ids = await _off_loop(len(str(messages)),
                                  lambda: tok.apply_chat_template(messages, gen), gw, tenant)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
    limit = gw.cfg.max_model_len
    if len(ids) > limit:
        raise ApiError(400, f"this model's context is {limit} tokens; this text is "
                       f"{len(ids)}", param="prompt", code="context_length_exceeded")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
    if strs:
        out["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = _body(await read_json(request), gw)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise invalid("'tokens' must be a list of token ids", "tokens", "invalid_type")
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise invalid(f"'tokens' takes at most {MAX_DETOKENIZE_IDS} ids", "tokens")
    vocab = gw.tokenizer.vocab_size
    if any(not 0 <= x < vocab for x in ids):
        raise invalid(f"token ids must be in [0, {vocab})", "tokens")
    text = await _off_loop(len(ids) * 4, lambda: gw.tokenizer.decode(ids))
    return json_response({"prompt": text})


async def models(request: web.Request) -> web.Response:
    """Every served model, each with what it serves, so a client can find the embedding model."""
    gw = request.app[GATEWAY]
    created = int(gw.started_at)
    data = [{"id": gw.cfg.model_name, "object": "model", "created": created,
             "owned_by": "batcher", "max_model_len": gw.cfg.max_model_len,
             "task": "generate", "endpoints": GENERATION_ROUTES, **gw.cfg.model_info}]
    if gw.embedder is not None and gw.embedder_name:
        data.append({"id": gw.embedder_name, "object": "model", "created": created,
                     "owned_by": "batcher", "task": "embed", "endpoints": EMBEDDING_ROUTES})
    return json_response({"object": "list", "data": data})


def add_routes(app: web.Application, **kw: Any) -> None:
    app.router.add_post("/tokenize", tokenize, **kw)
    app.router.add_post("/detokenize", detokenize, **kw)

