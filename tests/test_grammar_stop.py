"""How a grammar-constrained request ends: `ignore_eos` cannot turn a finished grammar into a run
of end-of-sequence tokens, and a request cut for its grammar's cost ends with that error even
when the step that cut it sampled end of sequence.
"""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.outputs import ScheduledSeq
from batcher.core.stopping import stop_status, suppressed_tokens
from batcher.engine.engine import AsyncEngine
from batcher.core.request import Request, RequestStatus
from batcher.runtime import grammar as grammar_masks
from batcher.runtime.grammar import GrammarMasks
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from batcher.structured.grammars import choice_grammar, regex_grammar
from batcher.tokenizer.tokenizer import load_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer()
    assert tokenizer.eos_token_ids == (EOS,)
    return tokenizer


def _allowed(masks: GrammarMasks, sp: SamplingParams, made: tuple[int, ...]) -> set[int]:
    row = ScheduledSeq("r", [made[-1] if made else 1], 1, [0], True, sp,
                       output_index=len(made), history=(1, *made))
    bits = masks.wait(masks.start([row]), [row]).bitmask[0]
    return {t for t in range(bits.numel() * 32) if int(bits[t // 32]) >> (t % 32) & 1}


def test_ignore_eos_bans_eos_while_the_grammar_allows_more(tok) -> None:
    grammar = regex_grammar("a+", "r")
    made = tuple(tok.encode("a"))
    plain = _allowed(GrammarMasks(tok), SamplingParams(grammar=grammar), made)
    assert EOS in plain and len(plain) > 1  # "a" may end or go on
    ignoring = _allowed(GrammarMasks(tok), SamplingParams(grammar=grammar, ignore_eos=True), made)
    assert ignoring == plain - {EOS}


def test_ignore_eos_keeps_eos_when_the_grammar_is_complete(tok) -> None:
    sp = SamplingParams(grammar=choice_grammar(["no"], "c"), ignore_eos=True)
    assert _allowed(GrammarMasks(tok), sp, tuple(tok.encode("no"))) == {EOS}


def test_a_grammar_row_stops_on_eos_even_under_ignore_eos() -> None:
    free = Request("a", [1], SamplingParams(ignore_eos=True), eos_token_ids=(EOS,))
    constrained = Request("b", [1], SamplingParams(ignore_eos=True, grammar='start: "x"'),
                          eos_token_ids=(EOS,))
    for req in (free, constrained):
        req.token_ids.append(EOS)
    assert stop_status(free, EOS, 100) is None
    assert stop_status(constrained, EOS, 100) is RequestStatus.FINISHED_STOPPED


async def test_a_cut_request_ends_with_its_error_not_a_stop(tok, tiny_fp32, monkeypatch) -> None:
    # Every charged mask is over budget: the step that cuts the row gives it an EOS-only mask,
    # so it samples EOS, which must not end it as an ordinary stop first.
    monkeypatch.setattr(grammar_masks, "ROW_BUDGET_S", -1.0)
    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=16)
    engine = AsyncEngine(runner, tok, SchedulerConfig(max_num_seqs=8))
    await engine.start()
    try:
        sp = SamplingParams(max_tokens=16, temperature=0, grammar=regex_grammar("[a-z]+", "r"))
        events = [ev async for ev in engine.generate(
            Request("cut", [100, 200, 300], sp, eos_token_ids=tok.eos_token_ids))]
    finally:
        await asyncio.wait_for(engine.stop(), 30)
    last = events[-1]
    assert last.finish_reason == "error", [(e.finish_reason, e.token_ids) for e in events]
    assert last.error and last.error.startswith(grammar_masks.GRAMMAR_TOO_COSTLY)
    assert EOS not in [t for e in events for t in e.token_ids]


def test_min_tokens_holds_eos_back_from_a_grammar_row_under_ignore_eos() -> None:
    free = Request("a", [1], SamplingParams(ignore_eos=True, min_tokens=4), eos_token_ids=(EOS,))
    constrained = Request("b", [1], SamplingParams(ignore_eos=True, min_tokens=4,
                                                   grammar='start: "x"'), eos_token_ids=(EOS,))
    assert suppressed_tokens(free) == ()
    assert suppressed_tokens(constrained) == (EOS,)


def test_a_tenant_cut_for_its_grammar_cools_down_alone() -> None:
    from batcher.http.errors import ApiError
    from batcher.server.grammar_cooldown import grammar_cooldown

    now = [100.0]
    cool = grammar_cooldown(10.0, clock=lambda: now[0])
    cool.check("alice")  # never cut: served
    cool.note("alice")
    now[0] += 2.5
    with pytest.raises(ApiError) as e:
        cool.check("alice")
    assert (e.value.status, e.value.code, e.value.retry_after) == (429, "grammar_cooldown", 8)
    cool.check("bob")  # another tenant is not held
    now[0] += 7.6
    cool.check("alice")  # the cool-down is over


def test_a_grammar_is_seen_in_a_body_before_it_is_parsed() -> None:
    from batcher.server.grammar_cooldown import asks_for_grammar

    assert asks_for_grammar({"guided_json": {"type": "object"}})
    assert asks_for_grammar({"response_format": {"type": "json_schema"}})
    assert not asks_for_grammar({"response_format": {"type": "text"}, "prompt": "x"})
    assert not asks_for_grammar({"guided_regex": None})
    assert not asks_for_grammar(["not", "an", "object"])


def test_a_row_is_charged_for_its_masks_work_not_for_waiting(tok) -> None:
    """The budget counts the CPU time the mask took, so a row whose helper thread only waited
    (another thread's garbage collection holding the GIL, a busy machine) is not cut, and one
    whose mask works as long is."""
    import time

    masks = GrammarMasks(tok)
    sp = SamplingParams(temperature=0, grammar=regex_grammar("[a-z]+", "r"))
    row = ScheduledSeq("r", [1], 1, [0], True, sp, output_index=0, history=(1,))
    masks.wait(masks.start([row]), [row])  # builds the matcher (its first mask is not charged)
    inner = masks._rows["r"].matcher
    late = 2 * grammar_masks.ROW_BUDGET_S

    class Waiting:
        """The row's matcher, its every mask `late` seconds late without working for it."""

        def __getattr__(self, name: str):
            return getattr(inner, name)

        def unsafe_compute_mask_ptr(self, *args):
            time.sleep(late)
            return inner.unsafe_compute_mask_ptr(*args)

    class Working(Waiting):
        def unsafe_compute_mask_ptr(self, *args):
            end = time.thread_time() + late
            while time.thread_time() < end:
                pass
            return inner.unsafe_compute_mask_ptr(*args)

    masks._rows["r"].matcher = Waiting()
    for _ in range(3):
        masks.wait(masks.start([row]), [row])
    assert masks.take_cut() == {}
    masks._rows["r"].matcher = Working()
    masks.wait(masks.start([row]), [row])
    assert masks.take_cut()["r"].startswith(grammar_masks.GRAMMAR_TOO_COSTLY)
    masks.close()
