"""Tool-call formats: the registry behind `--tool-call-parser`, each format's text read whole and
streamed (deltas assembled as the official client does), forced-call grammars, and a native
chat template receiving `tools` and earlier calls."""

from __future__ import annotations

import copy
import json
import random

import pytest

from batcher.server.protocol import parse_generation
from batcher.server.tool_parsers import PARSERS, get_parser, parse_tools
from batcher.tokenizer.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = parse_tools({"tools": [WEATHER, TIME]})
PARIS = {"city": "Paris \"FR\" {x}"}
TOKYO = {"zone": "Asia/Tokyo"}

# Each format's text of: a reply, one call, two calls (and Hermes: a reply before its calls).
TEXTS = {
    "generic": [
        ("It is sunny.", "It is sunny.", []),
        (json.dumps({"name": "get_weather", "arguments": PARIS}), None, [("get_weather", PARIS)]),
        (" " + json.dumps([{"name": "get_weather", "arguments": PARIS},
                           {"name": "get_time", "arguments": TOKYO}]), None,
         [("get_weather", PARIS), ("get_time", TOKYO)]),
    ],
    "hermes": [
        ("It is sunny.", "It is sunny.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(PARIS)
         + "}\n</tool_call>", None, [("get_weather", PARIS)]),
        ("Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS})
         + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": "get_time", "arguments": TOKYO})
         + "\n</tool_call>", "Let me check.", [("get_weather", PARIS), ("get_time", TOKYO)]),
    ],
    "llama3_json": [
        ("It is sunny.", "It is sunny.", []),
        ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(PARIS) + "}", None,
         [("get_weather", PARIS)]),
        (json.dumps({"name": "get_weather", "parameters": PARIS}) + "; "
         + json.dumps({"parameters": TOKYO, "name": "get_time"}), None,
         [("get_weather", PARIS), ("get_time", TOKYO)]),
    ],
}
CASES = [(name, *case) for name, cases in TEXTS.items() for case in cases]


def test_the_registry_names_its_choices() -> None:
    assert set(PARSERS) == {"generic", "hermes", "llama3_json"}
    with pytest.raises(ValueError, match="generic.*hermes.*llama3_json"):
        get_parser("mistral")
    # A format of the template's own needs a template that renders tools.
    with pytest.raises(ValueError, match="tools"):
        get_parser("hermes", load_tokenizer().chat_template)
    assert get_parser("generic", None).name == "generic"


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_answers(fmt: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = get_parser(fmt, "tools").parse(text, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in got or []] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got or [])
    assert len({c["id"] for c in got or []}) == len(calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_streamed_answers(fmt: str, text: str, content: str | None, calls: list) -> None:
    """Text in pieces of 1-4 characters, as tokens come: the reply streams, each call's first
    delta names it, its arguments come in fragments while they arrive."""
    rng = random.Random(len(text))
    stream = get_parser(fmt, "tools").stream(TOOLS)
    shown, deltas, pieces = "", [], []
    i = 0
    while i < len(text):
        n = rng.randint(1, 4)
        pieces.append(text[i:i + n])
        i += n
    for piece in pieces:
        s, d = stream.feed(piece)
        shown += s
        deltas += d
    s, d = stream.end()
    shown, deltas = shown + s, deltas + d
    assert shown.strip() == (content or "")
    assert stream.called == bool(calls)
    assembled: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in assembled:  # the first delta of a call names it
            assert d["id"].startswith("call_") and d["type"] == "function"
            assembled[d["index"]] = {"name": d["function"]["name"], "args": ""}
        else:
            assert "id" not in d and "name" not in d["function"]
        assembled[d["index"]]["args"] += d["function"]["arguments"]
    got = [(c["name"], json.loads(c["args"])) for _, c in sorted(assembled.items())]
    assert got == calls
    if calls and '"name"' in text.split("arguments")[0].split("parameters")[0]:
        # Name first: arguments arrive in several fragments, not one at the end.
        assert sum(1 for d in deltas if d["function"]["arguments"]) > len(calls)


def test_a_reply_is_never_held_longer_than_it_may_open_a_call() -> None:
    hermes = get_parser("hermes", "tools").stream(TOOLS)
    assert hermes.feed("Sure <tool") == ("Sure ", [])  # may open a call: held
    assert hermes.feed("box> ok") == ("<toolbox> ok", [])
    generic = get_parser("generic").stream(TOOLS)
    assert generic.feed("  ") == ("", []) and generic.end() == ("  ", [])
    # A cut call (max_tokens) in a whole answer is text, not a call a client could run.
    cut = '{"name": "get_weather", "arguments": {"ci'
    assert get_parser("generic").parse(cut, TOOLS) == (cut, None)
    # An object that is no call takes no index and makes no tool_calls answer.
    llama = get_parser("llama3_json", "tools").stream(TOOLS)
    assert llama.feed('{"x": 1}; {"name": "get_time", ') == ("", [])
    _, deltas = llama.feed('"parameters": {}}')
    assert deltas[0]["index"] == 0 and llama.called
    stray = get_parser("llama3_json", "tools").stream(TOOLS)
    stray.feed('{"x": 1}')
    assert not stray.called


def test_a_long_object_is_read_once_not_once_per_token(monkeypatch) -> None:
    """An object whose head is not first (arguments before the name, or no call at all) is held
    until it closes; each token must scan only itself, or a long one costs quadratic time on
    the event loop. Its head is looked for in a bounded prefix; past that it is sent whole."""
    from batcher.server.tool_parsers import stream as stream_mod

    read: list[int] = []
    head_end = stream_mod._Call._head_end

    def counted(self):  # characters this feed's scan reads
        read.append(len(self.buf) - self.scanned)
        return head_end(self)

    monkeypatch.setattr(stream_mod._Call, "_head_end", counted)
    value = "xyzw" * 5000
    text = json.dumps({"arguments": {"city": value}, "name": "get_weather"})
    stream = get_parser("generic").stream(TOOLS)
    deltas = []
    for i in range(0, len(text), 4):
        deltas += stream.feed(text[i:i + 4])[1]
    assert sum(read) == len(text)  # each character once (it was once per token each)
    [call] = deltas
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": value}
    # A head past the bounded prefix: the call still arrives, whole, when the object closes.
    late = "{" + " " * stream_mod.HEAD_MAX_CHARS + '"name": "get_time", "arguments": {}}'
    stream = get_parser("generic").stream(TOOLS)
    deltas = [d for i in range(0, len(late), 3) for d in stream.feed(late[i:i + 3])[1]]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        ("get_time", "{}")]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_forced_calls_compile_to_grammars(fmt: str) -> None:
    parser = get_parser(fmt, "tools")
    for body in ({"tool_choice": "required"}, {"tool_choice": "required",
                                               "parallel_tool_calls": False},
                 {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}):
        spec = parse_tools({"tools": [WEATHER, TIME], **body})
        assert parser.grammar(spec) is not None
    auto = parser.grammar(parse_tools({"tools": [WEATHER]}))
    assert (auto is not None) == (fmt == "generic")  # native formats leave auto answers free


def test_parallel_tool_calls_false_allows_one_call() -> None:
    one = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    many = parse_tools({"tools": [WEATHER]})
    assert many.parallel and many.many and not one.many
    gen = get_parser("generic")
    assert "JSON array" in gen.render([{"role": "user", "content": "x"}], many)[0]["content"]
    assert "JSON array" not in gen.render([{"role": "user", "content": "x"}], one)[0]["content"]


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_native_template_receives_tools_and_earlier_calls() -> None:
    tok = copy.copy(load_tokenizer())
    tok.hf = copy.copy(tok.hf)
    tok.hf.chat_template = QWEN_LIKE
    hermes = get_parser("hermes", tok.chat_template)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    spec = parse_generation({"messages": history, "tools": [WEATHER]}, True, {"m"}, 1000,
                            hermes)
    assert spec.sampling.grammar is None and spec.chat_tools is not None
    text = tok.decode(tok.apply_chat_template(spec.messages, tools=spec.chat_tools),
                      skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tools, listed
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "18 C" in text
    none = parse_generation({"messages": history, "tools": [WEATHER], "tool_choice": "none"},
                            True, {"m"}, 1000, hermes)
    assert none.chat_tools == [] and none.sampling.grammar is None
    text = tok.decode(tok.apply_chat_template(none.messages, tools=none.chat_tools),
                      skip_special_tokens=False)
    assert "<tools>" not in text and "<tool_call>" in text


def test_the_serve_flag_takes_the_registry_names(capsys) -> None:
    import argparse

    from batcher.app.serve_flags import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).tool_call_parser == "generic"
    assert p.parse_args(["--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "mistral"])
    assert "choose from 'generic', 'hermes', 'llama3_json'" in capsys.readouterr().err


def test_a_forced_call_cut_short_stays_a_call() -> None:
    """max_tokens ends a forced call mid-arguments: the answer is that call with the arguments
    as far as they got (as the stream sent them), in every format; an auto answer cut short
    stays text."""
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    for fmt, text in (("generic", '{"name": "get_weather", "arguments": {"city": "Par'),
                      ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
                      ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par')):
        content, calls = get_parser(fmt, "tools").parse(text, named)
        assert content is None, fmt
        [call] = calls
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}, fmt
        assert call["id"].startswith("call_")
    # Cut before the name is complete: the named tool's call, no arguments yet; under
    # "required" no tool is named yet, so the text it is.
    content, calls = get_parser("generic", "tools").parse('{"name": "get_wea', named)
    assert content is None and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": ""}]
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    content, calls = get_parser("generic", "tools").parse('{"name": "get_wea', required)
    assert content == '{"name": "get_wea' and calls is None


def test_call_schemas_close_objects_that_do_not_ask_for_other_keys() -> None:
    from batcher.server.tool_parsers.spec import closed_objects

    schema = {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "properties": {"type": "object", "properties": {"x": {}}},  # a key named so
        "mix": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
    }, "$defs": {"d": {"type": "object", "properties": {"z": {}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["properties"]["additionalProperties"] is False
    assert set(props) == set(schema["properties"])  # no key invented in the names map
    assert all("additionalProperties" not in b for b in props["mix"]["allOf"])
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy: the client's schema is shown as is
    assert closed_objects({"type": "object"}) == {"type": "object"}  # names no keys: any


def test_a_forced_stream_cut_before_the_name_still_names_the_call() -> None:
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})
    st = get_parser("generic", "tools").stream(named)
    assert st.feed('{"name": "get_t') == ("", [])
    text, deltas = st.end()
    assert text == "" and [d["function"] for d in deltas] == [
        {"name": "get_time", "arguments": ""}] and st.called
