"""OpenAI parity: the sampling surface (penalties, logit bias, min_p, stop token ids, 20 top
logprobs), echo, integer priority, an optional `model`, `/tokenize` and `/detokenize`, every
served model in `/v1/models`, and a 400 naming each field the server cannot honour.

The sampler and the request schema are checked directly, the HTTP layer in-process over the tiny
model, and the whole once more against a real `batcher serve` of the bundled model with the
official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch
from openai import OpenAI

from batcher.core.outputs import ScheduledSeq
from batcher.http.errors import ApiError
from batcher.runtime.sampler import Sampler
from batcher.core.sampling import SamplingParams
from batcher.server.protocol import parse_generation
from batcher.tokenizer.tokenizer import incomplete_utf8_tail, load_tokenizer
from tests.server_process import Server, assert_error_shape, serve
from tests.test_gateway_inprocess import ALICE, TENANTS, app_factory

VOCAB = 64
SERVED = {"tiny"}


def seq(sp: SamplingParams, history: tuple[int, ...] = (), outputs: int = 0) -> ScheduledSeq:
    return ScheduledSeq("r", [history[-1] if history else 0], max(0, len(history) - 1), [0],
                        True, sp, output_index=outputs, history=history)


# the sampler -----------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0
    rows = [seq(SamplingParams(temperature=0, logit_bias={7: 100.0})),
            seq(SamplingParams(temperature=0, logit_bias={5: -100.0}))]
    tokens, _ = Sampler(seed=0).sample(logits, rows)
    assert tokens[0] == 7  # forced
    assert tokens[1] != 5  # banned


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 1.0, 0.9
    prompt = (3, 3, 3)  # in the prompt only: no presence or frequency penalty
    plain = seq(SamplingParams(temperature=0, presence_penalty=2.0), prompt + (9,), outputs=1)
    assert Sampler().sample(logits, [plain])[0] == [3]
    made = seq(SamplingParams(temperature=0, presence_penalty=0.5), prompt + (3,), outputs=1)
    assert Sampler().sample(logits, [made])[0] == [4]  # 1.0 - 0.5 < 0.9
    # Frequency scales with the count: two 3s cost 2 x 0.04 = 0.08 (< 0.1 gap), three cost 0.12.
    twice = seq(SamplingParams(temperature=0, frequency_penalty=0.04), prompt + (3, 3), 2)
    thrice = seq(SamplingParams(temperature=0, frequency_penalty=0.04), prompt + (3, 3, 3), 3)
    assert Sampler().sample(logits.repeat(2, 1), [twice, thrice])[0] == [3, 4]


def test_repetition_penalty_covers_the_prompt_and_both_signs() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    row = seq(SamplingParams(temperature=0, repetition_penalty=1.5), (3, 1), outputs=0)
    assert Sampler().sample(logits, [row])[0] == [4]  # 2.0 / 1.5 < 1.5
    neg = torch.full((1, VOCAB), -5.0)
    neg[0, 3], neg[0, 4] = -1.0, -1.2
    row = seq(SamplingParams(temperature=0, repetition_penalty=1.5), (3,), outputs=0)
    assert Sampler().sample(neg, [row])[0] == [4]  # -1.0 x 1.5 < -1.2


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 10] = 5.0
    logits[0, 11] = 4.5  # p11 / p10 = e^-0.5 = 0.61
    sampler = Sampler(seed=0)
    picks = {sampler.sample(logits, [seq(SamplingParams(temperature=1.0, min_p=0.5))])[0][0]
             for _ in range(200)}
    assert picks == {10, 11}
    # Without min_p the 62 other tokens (e^-6 of the best each) show up over many draws.
    free = {sampler.sample(logits, [seq(SamplingParams(temperature=1.0))])[0][0]
            for _ in range(400)}
    assert len(free) > 2


def test_adjusted_seeded_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=g)
    mine = seq(SamplingParams(temperature=0.8, seed=42, presence_penalty=1.0, min_p=0.05,
                              logit_bias={1: 3.0}, top_p=0.9), (5, 6, 7, 6), outputs=2)
    others = [seq(SamplingParams(temperature=1.0, frequency_penalty=2.0), (1, 2), 1),
              seq(SamplingParams(temperature=0)), seq(SamplingParams(top_k=5))]
    alone = [Sampler(seed=s).sample(logits[:1], [mine])[0][0] for s in range(5)]
    mixed = [Sampler(seed=s).sample(logits, [mine, *others])[0][0] for s in range(5)]
    assert alone == mixed


def test_logprobs_report_the_model_distribution_and_twenty_alternatives() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    row = seq(SamplingParams(temperature=0, logprobs=20, logit_bias={0: 100.0}))
    [token], [lp] = Sampler().sample(logits, [row])
    assert token == 0 and lp is not None and len(lp.top) == 20
    assert lp.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item(), abs=1e-5)


# the request schema ----------------------------------------------------------------------------
UNSUPPORTED = [
    ("functions", [{}]), ("function_call", "auto"),
    ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]), ("prediction", {}),
    ("web_search_options", {}), ("reasoning_effort", "low"), ("store", True),
    ("service_tier", "flex"), ("guided_decoding_backend", "xgrammar"), ("ebnf", "x"),
    ("use_beam_search", True), ("prompt_logprobs", 1),
]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED)
@pytest.mark.parametrize("chat", [False, True])
def test_fields_we_cannot_honour_are_a_400_naming_them(field: str, value: object,
                                                       chat: bool) -> None:
    body = {"model": "tiny", field: value,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    with pytest.raises(ApiError) as err:
        parse_generation(body, chat, SERVED, 1000)
    assert err.value.status == 400 and err.value.param == field
    assert err.value.code == "unsupported"


def test_harmless_values_and_unknown_fields_pass() -> None:
    body = {"model": "tiny", "prompt": "hi", "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none", "modalities": ["text"], "store": False,
            "service_tier": "auto", "some_future_field": {"x": 1}}
    parse_generation(body, False, SERVED, 1000)


def test_the_sampling_surface_is_read() -> None:
    spec = parse_generation({"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1,
                             "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"7": -100},
                             "stop_token_ids": [3, 3, 9], "priority": 5, "logprobs": 20,
                             "echo": False}, False, SERVED, 1000)
    sp = spec.sampling
    assert spec.model == "tiny" and spec.priority == "batch"
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == (
        0.5, -1.0, 1.2, 0.1)
    assert sp.logit_bias == {7: -100.0} and sp.stop_token_ids == [3, 9] and sp.logprobs == 20
    assert parse_generation({"prompt": "x", "priority": -3}, False, SERVED, 9).priority == (
        "interactive")
    scoring = parse_generation({"prompt": "x", "echo": True, "logprobs": 3, "max_tokens": 0},
                               False, SERVED, 9)
    assert scoring.score_only and scoring.sampling.max_tokens == 1
    assert scoring.sampling.prompt_logprobs == 3
    chat = parse_generation({"messages": [], "logprobs": True, "top_logprobs": 20} | {
        "messages": [{"role": "user", "content": "x"}]}, True, SERVED, 9)
    assert chat.logprobs == 20


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"), ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"), ({"priority": 2**40}, "priority"),
])
def test_bad_values_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_generation({"prompt": "x", **body}, False, SERVED, 1000)
    assert err.value.status == 400 and err.value.param == param


def test_model_is_required_when_several_are_served() -> None:
    with pytest.raises(ApiError) as err:
        parse_generation({"prompt": "x"}, False, {"a", "b"}, 9)
    assert err.value.param == "model"


# text edges ------------------------------------------------------------------------------------
def test_incomplete_utf8_tail() -> None:
    assert incomplete_utf8_tail("ok €".encode()[:-1]) and incomplete_utf8_tail(b"\xf0\x9f")
    assert not incomplete_utf8_tail("ok €".encode()) and not incomplete_utf8_tail(b"")
    assert not incomplete_utf8_tail(b"\x80")  # a stray continuation byte is invalid, not cut


def test_token_bytes_rebuild_a_character_split_over_tokens() -> None:
    tok = load_tokenizer()
    ids = tok.encode("é😀", add_special_tokens=False)
    parts = [tok.token_bytes(t) for t in ids]
    assert b"".join(parts) == "é😀".encode()
    assert any(tok.decode([t]) == "\ufffd" for t in ids)  # a byte piece: its text alone is lost


# the HTTP layer, in-process over the tiny model ------------------------------------------------
AUTH = {"Authorization": f"Bearer {ALICE}"}


@pytest.fixture
async def client(aiohttp_client, tiny_fp32):
    return await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())


async def test_tokenize_detokenize_round_trip(client) -> None:
    tok = load_tokenizer()
    resp = await client.post("/tokenize", json={"prompt": "Hello there"}, headers=AUTH)
    body = await resp.json()
    assert resp.status == 200, body
    assert body["tokens"] == tok.encode("Hello there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024
    msgs = [{"role": "user", "content": "Hi"}]
    resp = await client.post("/tokenize", json={"model": "tiny", "messages": msgs},
                             headers=AUTH)
    assert (await resp.json())["tokens"] == tok.apply_chat_template(msgs)
    resp = await client.post("/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert (await resp.json()) == {"prompt": "Hello there"}
    for path, bad, param in [("/tokenize", {"prompt": 5}, "prompt"),
                             ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")]:
        resp = await client.post(path, json=bad, headers=AUTH)
        assert resp.status == 400
        assert assert_error_shape(await resp.json())["param"] == param
    assert (await client.post("/tokenize", json={"prompt": "x"})).status == 401


async def test_echo_stop_token_ids_and_logit_bias_over_http(client) -> None:
    tok = load_tokenizer()
    forced = tok.encode(" yes", add_special_tokens=False)[0]
    body = {"prompt": "Say", "max_tokens": 3, "logit_bias": {str(forced): 100},
            "temperature": 0, "echo": True}
    resp = await client.post("/v1/completions", json=body, headers=AUTH)
    out = await resp.json()
    assert resp.status == 200, out
    assert out["choices"][0]["text"] == "Say yes yes yes"
    body |= {"stop_token_ids": [forced], "return_token_ids": True}
    out = await (await client.post("/v1/completions", json=body, headers=AUTH)).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["token_ids"] == [forced] and out["choices"][0]["text"] == "Say yes"
    resp = await client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
    text = "".join([ev["choices"][0]["text"] async for ev in _events(resp)])
    assert text == "Say yes"


async def _events(resp):
    from tests.server_process import DONE, sse_events

    async for ev in sse_events(resp):
        if ev != DONE:
            yield ev


# the bundled model, official client ------------------------------------------------------------
@pytest.fixture(scope="module")
def real() -> Iterator[Server]:
    # The bundled model at `batcher serve`'s defaults, with the embedding model it serves too.
    with serve("--model", "smollm2-135m", "--embedding-model", "minilm", num_blocks=None,
               ready_timeout=180) as server:
        yield server


@pytest.mark.slow
def test_bundled_model_parity_with_the_openai_client(real: Server) -> None:
    oc = _client(real)
    models = {m.id: m.model_extra for m in oc.models.list()}
    assert "smollm2-135m" in models and len(models) == 2
    tasks = sorted(m["task"] for m in models.values())
    assert tasks == ["embed", "generate"]
    msgs = [{"role": "user", "content": "List three colours."}]
    # Penalties change a greedy answer that repeats itself; the default repeats.
    plain = oc.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24,
                                       temperature=0)
    penal = oc.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24,
                                       temperature=0, frequency_penalty=2.0,
                                       presence_penalty=2.0)
    assert plain.choices[0].message.content != penal.choices[0].message.content
    lp = oc.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=20)
    for entry in lp.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 20 and entry.bytes
    with pytest.raises(openai.BadRequestError) as err:
        oc.chat.completions.create(model="smollm2-135m", messages=msgs,
                                   audio={"voice": "alloy", "format": "wav"})
    assert err.value.body["param"] == "audio"
    # No `model`, an integer priority, and an answer cut mid-emoji ends without U+FFFD.
    status, out = _post(real.url + "/v1/completions", {
        "prompt": "Emoji: 😀😀😀😀", "max_tokens": 2, "temperature": 0, "priority": -1})
    assert status == 200, out
    status, tok = _post(real.url + "/tokenize", {"prompt": "😀"})
    assert status == 200 and tok["count"] > 1  # the emoji spans byte-piece tokens
    status, out = _post(real.url + "/v1/completions", {
        "prompt": "x", "max_tokens": 1, "logit_bias": {str(tok["tokens"][0]): 100}})
    assert status == 200 and not out["choices"][0]["text"].endswith("\ufffd")
    assert _post(real.url + "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": "😀"})


def _client(real: Server) -> OpenAI:
    # A generous timeout: a loaded 2-core machine runs these steps several times slower.
    return OpenAI(base_url=real.url + "/v1", api_key="none", max_retries=0, timeout=300,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    try:
        with opener.open(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


# structured outputs ----------------------------------------------------------------------------
# NOTE: bounded, so a sampled answer always closes within the tests' max_tokens (an unbounded
# integer can run on for as long as the sampler keeps picking digits)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_grammar": "start: ???"},
                                                    "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
])
def test_bad_grammars_are_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_generation({"prompt": "x", **body}, False, SERVED, 1000)
    assert err.value.status == 400 and err.value.param == param


def test_every_grammar_source_compiles() -> None:
    for body in ({"response_format": {"type": "json_object"}},
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "p", "schema": PERSON,
                                                      "strict": True}}},
                 {"guided_json": PERSON}, {"guided_regex": "[0-9]{3}"},
                 {"guided_choice": ["yes", "no"]},
                 {"guided_grammar": 'start: "a" | "b"'},
                 {"guided_grammar": 'root ::= "a" | "b"'}):
        assert parse_generation({"prompt": "x", **body}, False, SERVED, 9).sampling.grammar
    text = {"response_format": {"type": "text"}}
    assert parse_generation({"prompt": "x", **text}, False, SERVED, 9).sampling.grammar is None


def test_grammar_masks_survive_preemption_and_leave_free_rows_alone() -> None:
    from batcher.runtime.grammar import GrammarMasks
    from batcher.structured.grammars import choice_grammar

    tok = load_tokenizer()
    masks = GrammarMasks(tok)
    sp = SamplingParams(temperature=0, grammar=choice_grammar(["yes please", "no"], "c"))
    free = seq(SamplingParams(temperature=0))
    assert masks.start([free]) is None  # nothing constrained: no work at all
    first = ScheduledSeq("a", [1], 0, [0], True, sp, output_index=0, history=(1,))
    step = masks.wait(masks.start([free, first]), [free, first])
    assert step.rows == [1]
    logits = torch.zeros(2, tok.vocab_size)
    tokens, _ = Sampler().sample(logits, [free, first], step)
    piece = tok.decode([tokens[1]])
    assert piece and ("yes please".startswith(piece) or "no".startswith(piece))
    masks.advance([free, first], tokens)
    prompt_and_out = (1, tokens[1])
    nxt = ScheduledSeq("a", [tokens[1]], 1, [0], True, sp, output_index=1,
                       history=prompt_and_out)
    kept = masks.wait(masks.start([nxt]), [nxt]).bitmask.clone()
    masks.drop(["a"])  # preempted: the matcher is rebuilt from the output so far
    rebuilt = masks.wait(masks.start([nxt]), [nxt]).bitmask
    assert torch.equal(kept, rebuilt)


async def test_structured_output_over_http_streamed_with_n(client) -> None:
    body = {"prompt": "Answer:", "max_tokens": 8, "guided_choice": ["alpha", "beta"],
            "n": 2, "temperature": 1.0, "seed": 3}
    out = await (await client.post("/v1/completions", json=body, headers=AUTH)).json()
    assert [c["text"] for c in out["choices"]] and all(
        c["text"] in ("alpha", "beta") and c["finish_reason"] == "stop" for c in out["choices"])
    resp = await client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
    texts = ["", ""]
    async for ev in _events(resp):
        for c in ev["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in out["choices"]]  # seeded: the same answers


@pytest.mark.slow
def test_bundled_model_structured_outputs(real: Server) -> None:
    """On the bundled model: a strict JSON schema (whole and streamed with n=2), a regex."""
    oc = _client(real)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    out = oc.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=60,
                                     temperature=0, response_format=fmt)
    person = json.loads(out.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert out.choices[0].finish_reason == "stop"
    stream = oc.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=60,
                                        temperature=1.0, seed=7, n=2, response_format=fmt,
                                        stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for t in texts:
        assert set(json.loads(t)) == {"name", "age"}
    out = oc.completions.create(model="smollm2-135m", prompt="The year was", max_tokens=10,
                                extra_body={"guided_regex": " [12][0-9]{3}\\."})
    assert re.fullmatch(r" [12][0-9]{3}\.", out.choices[0].text), out.choices[0].text


# tool calling ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_generation({"messages": CHAT, **body}, True, SERVED, 1000)
    assert err.value.status == 400 and err.value.param == param


def test_tools_render_into_the_chat_and_constrain_the_answer() -> None:
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    spec = parse_generation({"messages": history, "tools": [WEATHER]}, True, SERVED, 1000)
    assert spec.messages[0]["role"] == "system" and "get_weather" in spec.messages[0]["content"]
    assert json.loads(spec.messages[2]["content"]) == {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}
    assert spec.messages[3] == {"role": "tool", "content": "18 C, sunny"}
    assert spec.sampling.grammar is not None  # auto: a call or a reply
    none = parse_generation({"messages": history, "tools": [WEATHER], "tool_choice": "none"},
                            True, SERVED, 1000)
    assert none.sampling.grammar is None and none.messages[0]["role"] == "user"
    load_tokenizer().apply_chat_template(spec.messages)  # the template takes it


def test_generic_stream_holds_a_call_and_releases_a_reply() -> None:
    from batcher.server.tool_parsers import get_parser, parse_tools

    auto = parse_tools({"tools": [WEATHER]})
    gen = get_parser("generic")
    st = gen.stream(auto)
    assert st.feed(" ") == ("", []) and st.feed("It is") == (" It is", [])
    assert st.feed(" warm") == (" warm", []) and st.end() == ("", []) and not st.called
    st = gen.stream(auto)
    text, head = st.feed('{"name": "get_weather", ')
    assert text == "" and head == []
    text, deltas = st.feed('"arguments": {"city": "Oslo"}}')
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["index"] == 0
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo"}
    assert st.called
    content, calls = gen.parse('{"name": "get_wea', auto)  # cut by max_tokens: text
    assert content == '{"name": "get_wea' and calls is None


@pytest.mark.slow
def test_bundled_model_agent_loop(real: Server) -> None:
    """user -> tool call -> tool result -> answer, on the bundled model."""
    oc = _client(real)
    messages: list[dict] = list(CHAT)
    first = oc.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER],
                                       tool_choice="required", max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = oc.chat.completions.create(model="smollm2-135m", messages=messages,
                                        tools=[WEATHER], tool_choice="none", max_tokens=16,
                                        temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # Streamed, a named choice: the call arrives as tool_calls deltas.
    stream = oc.chat.completions.create(
        model="smollm2-135m", messages=list(CHAT), tools=[WEATHER], max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    name, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls" and "city" in json.loads(args)
    # auto: either a valid call or a reply, never anything else.
    auto = oc.chat.completions.create(model="smollm2-135m", messages=list(CHAT),
                                      tools=[WEATHER], max_tokens=24, temperature=0)
    msg = auto.choices[0].message
    assert (msg.tool_calls and auto.choices[0].finish_reason == "tool_calls") or (
        msg.content and not msg.content.lstrip().startswith("{"))


# A schema as clients write them: extra keys not forbidden, and no bound on the string.
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.slow
def test_bundled_model_forced_call_cut_short_stays_a_call(real: Server) -> None:
    """A named tool_choice whose answer is cut by max_tokens is still a tool call (its
    arguments as far as they got, finish_reason length), never the call's raw JSON as
    content; with room, the arguments hold only the keys the schema names."""
    oc = _client(real)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for max_tokens in (3, 12):  # cut in the tool's name, then in its arguments
        cut = oc.chat.completions.create(model="smollm2-135m", messages=list(CHAT),
                                         tools=[OPEN_WEATHER], tool_choice=named,
                                         max_tokens=max_tokens, temperature=0)
        choice = cut.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{"), call
    full = oc.chat.completions.create(model="smollm2-135m", messages=list(CHAT),
                                      tools=[OPEN_WEATHER], tool_choice=named, max_tokens=80,
                                      temperature=0)
    choice = full.choices[0]
    assert choice.message.content is None and choice.message.tool_calls, choice
    args = choice.message.tool_calls[0].function.arguments
    if choice.finish_reason == "tool_calls":
        assert set(json.loads(args)) <= {"city", "unit"}, args
    else:  # a string value that ran to the cut: still no invented key before it
        assert choice.finish_reason == "length", choice
        assert args.lstrip().startswith(('{"city"', '{"unit"', '{ "city"', '{ "unit"')), args


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}


def _call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.mark.slow
def test_bundled_model_parallel_tool_calls(real: Server) -> None:
    """With parallel_tool_calls (the default) the answer may hold several calls, each with its
    own id; with false the grammar allows one. The chat shows an earlier turn with two calls
    (rendered as the format's JSON array), as an agent's history would."""
    oc = _client(real)
    msgs = [{"role": "user", "content": "What is the weather in Rome and the time in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                _call("c1", "get_weather", {"city": "Rome"}),
                _call("c2", "get_time", {"zone": "Europe/Oslo"})]},
            {"role": "tool", "tool_call_id": "c1", "content": "20 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
            {"role": "assistant", "content": "It is 20 C in Rome and 10:00 in Oslo."},
            {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
    kw = {"model": "smollm2-135m", "messages": msgs, "tools": [WEATHER, TIME],
          "tool_choice": "required", "max_tokens": 48, "temperature": 0}
    many = oc.chat.completions.create(**kw)
    calls = many.choices[0].message.tool_calls
    assert many.choices[0].finish_reason == "tool_calls" and calls and len(calls) >= 2
    assert len({c.id for c in calls}) == len(calls)
    assert {c.function.name for c in calls} == {"get_weather", "get_time"}
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    one = oc.chat.completions.create(**kw, parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls"
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_bundled_model_streams_tool_call_arguments(real: Server) -> None:
    """The official client's stream helper assembles the call from deltas; the arguments come
    in several fragments while they are generated, not in one delta at the end."""
    oc = _client(real)
    fragments = 0
    with oc.chat.completions.stream(
            model="smollm2-135m", messages=list(CHAT), tools=[WEATHER], max_tokens=32,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        for event in stream:
            fragments += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion()
    choice = final.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert fragments > 2


@pytest.mark.slow
def test_bundled_model_prompt_logprobs(real: Server) -> None:
    """echo + logprobs: the prompt's tokens with their logprobs (the first null); max_tokens 0
    scores a text. A prompt token's score equals the logprob it had when sampled."""
    oc = _client(real)
    prompt = "The capital of France is"
    first = oc.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1,
                                  temperature=0, logprobs=1)
    word = first.choices[0].text
    scored = oc.completions.create(model="smollm2-135m", prompt=prompt + word, max_tokens=0,
                                   echo=True, logprobs=2)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt + word and scored.usage.completion_tokens == 0
    assert "".join(lp.tokens) == prompt + word and lp.token_logprobs[0] is None
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:]) and lp.top_logprobs[0] is None
    assert lp.tokens[-1] == word
    assert abs(lp.token_logprobs[-1] - first.choices[0].logprobs.token_logprobs[0]) < 0.05
    # 64 choices of a 4,000-token prompt at 20 alternatives would hold millions of entries:
    # refused before any work.
    with pytest.raises(openai.BadRequestError) as err:
        oc.completions.create(model="smollm2-135m", prompt=[[100] * 4000] * 4, n=16,
                              max_tokens=0, echo=True, logprobs=20)
    assert err.value.body["code"] == "prompt_logprobs_too_large"


async def test_tokenize_and_models_through_the_router(aiohttp_client, tiny_fp32) -> None:
    from batcher.fleet.router.context import RouterConfig, RouterContext
    from batcher.fleet.router.proxy import create_router_app

    replica = await aiohttp_client(app_factory(tiny_fp32, load_tokenizer(), TENANTS)())
    ctx = RouterContext(RouterConfig())
    rep = ctx.registry.add_static(str(replica.make_url("")).rstrip("/"))
    assert ctx.registry.observe(rep.replica_id, await (await replica.get("/v1/state")).json(),
                                ctx.clock())
    rep.ready = True
    router = await aiohttp_client(create_router_app(ctx))
    direct = await (await replica.post("/tokenize", json={"prompt": "Hi there"},
                                       headers=AUTH)).json()
    resp = await router.post("/tokenize", json={"prompt": "Hi there"}, headers=AUTH)
    assert resp.status == 200 and await resp.json() == direct
    resp = await router.post("/detokenize", json={"tokens": direct["tokens"]}, headers=AUTH)
    assert (await resp.json()) == {"prompt": "Hi there"}
    resp = await router.post("/detokenize", json={"tokens": [-5]}, headers=AUTH)
    assert resp.status == 400 and assert_error_shape(await resp.json())["param"] == "tokens"
    models = (await (await router.get("/v1/models", headers=AUTH)).json())["data"]
    assert [(m["id"], m["task"]) for m in models] == [("tiny", "generate")]
    assert "/tokenize" in models[0]["endpoints"]


async def test_constrained_rows_survive_preemption(tiny_fp32) -> None:
    """Seeded constrained rows give the same tokens whether or not the KV pool forces
    preemption (each recompute rebuilds the matcher from the output so far), and every answer
    follows its grammar."""
    from batcher.core.config import SchedulerConfig
    from batcher.engine.engine import AsyncEngine
    from batcher.core.request import Request
    from batcher.runtime.model_runner import ModelRunner
    from batcher.structured.grammars import regex_grammar

    tok = load_tokenizer()
    grammar = regex_grammar("[a-z]{20,40}( [a-z]{20,40}){3}", "r")
    prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(20 + 9 * i)] for i in range(8)]

    async def run(num_blocks: int) -> tuple[list[list[int]], int]:
        runner = ModelRunner(tiny_fp32, num_blocks=num_blocks, block_size=16)
        engine = AsyncEngine(runner, tok, SchedulerConfig(max_num_seqs=64,
                                                          max_num_batched_tokens=256))
        await engine.start()

        async def one(i: int) -> list[int]:
            # Half the rows constrained, half free: both kinds in every batch.
            sp = SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=i % 2 == 1,
                                grammar=grammar if i % 2 == 0 else None)
            out: list[int] = []
            async for ev in engine.generate(Request(f"g{i}", prompts[i], sp,
                                                    eos_token_ids=tok.eos_token_ids)):
                out += ev.token_ids
            return out

        outs = await asyncio.gather(*(one(i) for i in range(8)))
        preemptions = engine.scheduler.stats.preemptions
        await engine.stop()
        return outs, preemptions

    want, _ = await run(256)
    got, preemptions = await run(14)
    assert preemptions > 0
    assert got == want
    for i in range(0, 8, 2):
        text = tok.decode(got[i])
        assert re.fullmatch("[a-z]{20,40}( [a-z]{20,40}){0,3}( [a-z]{0,40})?", text), text
