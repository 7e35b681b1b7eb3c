"""A batch line through the replica's own gateway, in-process (tiny model): it is admitted and
answered like a live request, but its first token never becomes evidence for the TTFT
correction that interactive admission applies (lines are served after later interactive
requests by design, so they come late against their prediction)."""

from __future__ import annotations

from batcher.batch.lines import LineRunner
from batcher.admission.feed import step_observer
from batcher.server.appkeys import GATEWAY
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory, auth, completion, tokenizer

__all__ = ["tokenizer"]  # the module-scoped fixture, shared


async def test_a_line_teaches_the_ttft_correction_nothing(aiohttp_client, tiny_fp32,
                                                          tokenizer) -> None:
    client = await aiohttp_client(app_factory(tiny_fp32, tokenizer, TENANTS)())
    gw = client.server.app[GATEWAY]
    # As `batcher serve` wires it: every step feeds admission's prefill rate.
    gw.engine.step_listeners.append(step_observer(gw.admission, gw.engine.scheduler,
                                                  gw.engine.step_time_model, lambda r, c: 0.01))
    predictor = gw.admission.predictor

    async def live() -> None:
        resp = await client.post("/v1/completions", json=completion(), headers=auth(ALICE))
        assert resp.status == 200, await resp.text()

    await live()  # measures a prefill rate: later admissions carry a prediction
    await live()
    seen = predictor.num_ttft_observations
    assert seen >= 1  # a live request with a prediction is compared at its first token
    result = await LineRunner(gw).run(TENANTS["alice"], "/v1/completions",
                                      completion(max_tokens=3, ignore_eos=True), "line-1")
    assert result.ok and result.body["usage"]["completion_tokens"] == 3
    assert predictor.num_ttft_observations == seen
    await live()
    assert predictor.num_ttft_observations == seen + 1


async def test_a_running_line_reports_its_prefill_and_steps_left(aiohttp_client, tiny_fp32,
                                                                 tokenizer) -> None:
    import asyncio

    client = await aiohttp_client(app_factory(tiny_fp32, tokenizer, TENANTS)())
    runner = LineRunner(client.server.app[GATEWAY])
    assert runner.steps_left("line-2") is None and not runner.in_prefill("line-2")
    task = asyncio.ensure_future(runner.run(TENANTS["alice"], "/v1/completions",
                                            completion(max_tokens=200, ignore_eos=True),
                                            "line-2"))
    seen: list[int] = []
    while not task.done():
        left = runner.steps_left("line-2")
        if left is not None:
            seen.append(left)
        await asyncio.sleep(0.001)
    assert (await task).ok
    assert seen and all(0 <= x <= 200 for x in seen) and seen == sorted(seen, reverse=True)
    assert min(seen) < 200  # it counted down while decoding
    assert runner.steps_left("line-2") is None


async def test_a_line_uses_the_served_tool_call_format(aiohttp_client, tiny_fp32) -> None:
    """Under a format other than the default, a line with tools is rendered and parsed by it,
    as the live endpoint does: the same prompt, the same answer."""
    import copy

    from batcher.server.tool_parsers import get_parser
    from batcher.tokenizer.tokenizer import load_tokenizer
    from tests.test_tool_parsers import QWEN_LIKE, WEATHER

    tok = copy.copy(load_tokenizer())
    tok.hf = copy.copy(tok.hf)
    tok.hf.chat_template = QWEN_LIKE
    client = await aiohttp_client(app_factory(tiny_fp32, tok, TENANTS)())
    gw = client.server.app[GATEWAY]
    gw.tool_parser = get_parser("hermes", tok.chat_template)  # as --tool-call-parser hermes
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=body, headers=auth(ALICE))
    live = await resp.json()
    assert resp.status == 200, live
    result = await LineRunner(gw).run(TENANTS["alice"], "/v1/chat/completions", body, "line-t")
    assert result.ok, result.body
    assert result.body["usage"]["prompt_tokens"] == live["usage"]["prompt_tokens"]
    assert result.body["choices"] == live["choices"]


async def test_lines_are_checked_and_sized_as_live_requests(aiohttp_client, tiny_fp32,
                                                            tokenizer) -> None:
    import pytest

    from batcher.batch.validate import LineCheck
    from batcher.http.errors import ApiError

    client = await aiohttp_client(app_factory(tiny_fp32, tokenizer, TENANTS)())
    gw = client.server.app[GATEWAY]
    check = LineCheck(gw)
    prompt = len(tokenizer.encode("Hello there"))
    assert check.cost("/v1/completions", completion(max_tokens=7)) == (prompt, 7)
    assert check.cost("/v1/completions", completion(max_tokens=7, n=3)) == (3 * prompt, 21)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    chat_prompt, chat_out = check.cost("/v1/chat/completions", chat)
    assert chat_prompt > 0 and chat_out == min(gw.cfg.default_max_tokens,
                                               gw.cfg.max_model_len - chat_prompt)
    cases = [
        (completion(max_tokens=999_999_999_999), "max_tokens", None),
        (completion(max_tokens=gw.cfg.max_model_len), "max_tokens", "context_length_exceeded"),
        (completion(model="nope"), "model", "model_not_found"),
        (completion(prompt=[[]]), "prompt", "invalid_type"),
    ]
    for body, param, code in cases:
        with pytest.raises(ApiError) as err:
            check.cost("/v1/completions", body)
        assert err.value.status == 400 and err.value.param == param
        assert code is None or err.value.code == code
    with pytest.raises(ApiError) as err:
        check.cost("/v1/embeddings", {"model": "e", "input": "x"})
    assert err.value.status == 404  # this server has no embedding model
