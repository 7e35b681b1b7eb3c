"""Reasoning output (`--reasoning-parser`): the think block becomes `reasoning_content`, in whole
answers and streams alike, and `chat_template_kwargs` reaches the chat template."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from batcher.engine.events import EngineEvent
from batcher.http.errors import ApiError
from batcher.server.choice_tally import Choice
from batcher.server.openai_routes import GenerationHandler
from batcher.server.protocol import GenerationSpec, parse_generation
from batcher.server.reasoning import PARSERS, get_reasoning_parser
from batcher.server.tool_parsers import get_parser

CASES = [  # parser, answer, reasoning, content
    ("qwen3", "<think>\nplan it</think>\n\nThe answer.", "\nplan it", "\n\nThe answer."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "The answer, no thinking.", None, "The answer, no thinking."),
    ("qwen3", "<think>cut off mid-thought", "cut off mid-thought", ""),
    ("qwen3", "<thin", None, "<thin"),  # a prefix of the tag that never completed
    ("deepseek_r1", "plan it</think>The answer.", "plan it", "The answer."),
    ("deepseek_r1", "<think>plan</think>ok", "plan", "ok"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "a < b </thinking> c</think>d", "a < b </thinking> c", "d"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_answers_split(name: str, text: str, reasoning: str | None, content: str) -> None:
    assert PARSERS[name].parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streams_split_as_whole_answers_do(name, text, reasoning, content, step) -> None:
    """Every cut of the text into deltas, tags split across them included, adds up to the
    whole answer's fields, and no delta carries a piece of a tag."""
    s = PARSERS[name].stream()
    parts = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.end()]
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content
    if text.count("</think>") == 1:
        assert not any("<" in r and "think" in r for r, _ in parts if r.endswith("</"))


def test_unknown_parser_is_refused_and_none_is_off() -> None:
    assert get_reasoning_parser(None) is None and get_reasoning_parser("none") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_parser("o1")
    from batcher.app.serve_flags import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).reasoning_parser is None
    assert p.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"


def _handler(parser: str | None) -> GenerationHandler:
    gw = SimpleNamespace(reasoning=get_reasoning_parser(parser), tool_parser=get_parser("generic"))
    return GenerationHandler(gw, chat=True)  # type: ignore[arg-type]


def _final(text: str) -> Choice:
    c = Choice()
    c.text = [text]
    c.final = EngineEvent("r", finish_reason="stop", num_prompt_tokens=3, num_output_tokens=9)
    return c


def test_whole_chat_answer_carries_reasoning_content() -> None:
    spec = GenerationSpec(chat=True, model="m")
    job = SimpleNamespace(requests=[None])
    body = _handler("qwen3")._whole(spec, "x", [_final("<think>hm</think>Hi")], job)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi",
                                             "reasoning_content": "hm"}
    # Without a parser the answer is untouched, and has no such field.
    body = _handler(None)._whole(spec, "x", [_final("<think>hm</think>Hi")], job)
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": "<think>hm</think>Hi"}


def test_streamed_chat_deltas_carry_reasoning_content() -> None:
    h = _handler("deepseek_r1")
    spec = GenerationSpec(chat=True, model="m")
    job = SimpleNamespace(requests=[None])
    thinking = {0: h.gw.reasoning.stream()}
    deltas = []
    pieces = ["Let me ", "see.</th", "ink>", "Four."]
    for k, piece in enumerate(pieces):
        ev = EngineEvent("r", text=piece, token_ids=[k],
                         finish_reason="stop" if k == len(pieces) - 1 else None)
        chunk = h._event_chunk({"id": "x"}, spec, job, 0, ev, set(), None, thinking)
        if chunk is not None:
            deltas.append(chunk["choices"][0]["delta"])
    assert deltas == [{"reasoning_content": "Let me "}, {"reasoning_content": "see."},
                      {"content": "Four."}]


def test_chat_template_kwargs_reach_the_template() -> None:
    from batcher.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer()
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    spec = parse_generation(body, chat=True, served_models={"m"}, vocab_size=tok.vocab_size)
    assert spec.template_kwargs == {"enable_thinking": False}
    template = ("{% if enable_thinking is defined and not enable_thinking %}no thinking: "
                "{% endif %}{{ messages[0]['content'] }}")
    tok.hf.chat_template = template
    off = tok.decode(tok.apply_chat_template(spec.messages,
                                             template_kwargs=spec.template_kwargs))
    on = tok.decode(tok.apply_chat_template(spec.messages))
    assert (off, on) == ("no thinking: hi", "hi")


@pytest.mark.parametrize(("kwargs", "message"), [
    ([1], "must be an object"), ({"add_generation_prompt": False}, "may not set"),
    ({"tools": []}, "may not set")])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(kwargs, message) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    with pytest.raises(ApiError) as err:
        parse_generation(body, chat=True, served_models={"m"}, vocab_size=100)
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"
    assert message in err.value.message
