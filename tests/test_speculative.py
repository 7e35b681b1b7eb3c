"""Speculative decoding by n-gram lookup: the proposer, the verify rule, the scheduler's
bookkeeping (KV reserved for drafts and given back, stops inside a drafted span) on a pure
fake model, and the engine on the tiny model: outputs equal to plain decoding."""

from __future__ import annotations

import asyncio

import pytest

from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.ngram_proposer import NgramProposer, can_speculate
from batcher.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.spec_verify import accepted, collapse, run_by_rule, verify_rows
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams

# -- the proposer -----------------------------------------------------------------------------


def test_proposer_continues_the_latest_earlier_occurrence() -> None:
    p = NgramProposer(k=3)
    # "1 2 3" occurred twice before; the latest occurrence (followed by 7 8 9) wins.
    assert p.propose([1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3]) == [7, 8, 9]
    assert p.propose([1, 2, 3, 4, 1, 2, 3], k=2) == [4, 1]  # k caps the proposal


def test_proposer_prefers_the_longest_match() -> None:
    p = NgramProposer(k=2)
    # The suffix "5 6" recurs once (followed by 7), "6" alone more recently (followed by 9).
    assert p.propose([5, 6, 7, 8, 6, 9, 5, 6]) == [7, 8]
    assert NgramProposer(k=2, min_n=1, max_n=1).propose([5, 6, 7, 8, 6, 9, 5, 6]) == [9, 5]
    # By default a lone recurring token is not enough.
    assert NgramProposer(k=2).propose([5, 6, 7, 8, 1, 6]) == []
    assert NgramProposer(k=2, min_n=1).propose([5, 6, 7, 8, 1, 6]) == [7, 8]


def test_proposer_without_a_match_proposes_nothing() -> None:
    p = NgramProposer(k=4)
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([7]) == []
    assert p.propose([]) == []
    assert p.propose([1, 2, 1], k=0) == []
    assert NgramProposer(k=2).propose([1, 9, 3, 1]) == []  # only a 1-gram recurs


def test_proposer_searches_only_its_window() -> None:
    tokens = [1, 2, 3, 4] + [9] * 40 + [1, 2, 3]
    assert NgramProposer(k=2).propose(tokens) == [4, 9]
    assert NgramProposer(k=2, window=20).propose(tokens) == []


def test_proposer_rejects_bad_settings() -> None:
    for kw in ({"k": 0}, {"k": 2, "min_n": 0}, {"k": 2, "min_n": 3, "max_n": 2},
               {"k": 2, "window": 3}):
        with pytest.raises(ValueError):
            NgramProposer(**kw)


def test_grammar_rows_and_rows_under_min_tokens_are_not_drafted() -> None:
    assert can_speculate(SamplingParams(), 0)
    assert not can_speculate(SamplingParams(grammar="{}"), 5)
    assert not can_speculate(SamplingParams(min_tokens=3), 2)
    assert can_speculate(SamplingParams(min_tokens=3), 3)


# -- the verify rule --------------------------------------------------------------------------


def test_accepted_keeps_the_agreeing_drafts_and_the_models_own_token() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 4  # all drafts, plus the token after them
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 2  # 5, then the model's 9
    assert accepted([5, 6, 7], [1, 6, 7, 8]) == 1  # the model's own token only


def test_verify_rows_sample_each_position_as_a_plain_decode() -> None:
    sp = SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.2)
    seq = ScheduledSeq("a", [4, 5, 6], 10, [0], True, sp, output_index=3, history=(1, 2, 4),
                       draft_token_ids=(5, 6))
    rows = verify_rows(seq)
    assert [r.output_index for r in rows] == [3, 4, 5]
    assert [r.history for r in rows] == [(1, 2, 4), (1, 2, 4, 5), (1, 2, 4, 5, 6)]
    plain = ScheduledSeq("b", [4], 10, [0], True, sp)
    assert verify_rows(plain) == [plain]


def test_collapse_keeps_each_rows_accepted_prefix_in_order() -> None:
    sp = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq("a", [1, 2, 3], 5, [0], True, sp, draft_token_ids=(2, 3)),
            ScheduledSeq("p", [7, 7], 0, [1], False, sp),  # a prefill chunk: no row
            ScheduledSeq("b", [4], 9, [2], True, sp)]
    ids, toks, lps = collapse(seqs, [2, 8, 3, 40], ["a0", "a1", "a2", "b0"])
    assert (ids, toks, lps) == (["a", "a", "b"], [2, 8, 40], ["a0", "a1", "b0"])


# -- the scheduler on a pure fake model -------------------------------------------------------


class CycleModel:
    """A deterministic 'model': the next token depends only on the last one and cycles with a
    short period, so n-gram drafts are usually right. Samples every drafted position as the
    real runner does."""

    def __init__(self, period: int = 7, break_every: int = 0) -> None:
        self.period = period
        self.break_every = break_every  # every so many positions, break the cycle

    def next_token(self, token: int, pos: int) -> int:
        if self.break_every and pos % self.break_every == 0:
            return 100 + pos % 13
        return 10 + (token + 1) % self.period

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return run_by_rule(sched.seqs, self.next_token)


def run_core(reqs: list[Request], model: CycleModel, num_blocks: int = 64,
             **cfg) -> tuple[dict[str, list[int]], dict[str, str], Scheduler]:
    kv = KVCacheManager(num_blocks, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      prefill_budget="fixed", **cfg), kv, debug_checks=True)
    for r in reqs:
        sched.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    reasons: dict[str, str] = {}
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step = sched.schedule()
        for s in step.seqs:  # a reserved slot for every drafted position
            assert len(s.block_ids) * 4 >= s.start_pos + s.num_tokens
        for u in sched.update(step, model.execute(step)):
            out[u.request_id] += u.new_token_ids
            if u.finished:
                reasons[u.request_id] = u.finish_reason
    assert not sched.has_unfinished()
    return out, reasons, sched


def requests() -> list[Request]:
    return [
        Request("long", [10, 11, 12, 13, 14, 15, 16, 10, 11],
                SamplingParams(max_tokens=40, temperature=0.0)),
        Request("stop-id", [12, 13, 14], SamplingParams(max_tokens=40, temperature=0.0,
                                                        stop_token_ids=[15], min_tokens=9)),
        Request("short", [10, 11, 12], SamplingParams(max_tokens=3, temperature=0.0)),
        Request("broken", [1, 2, 3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0)),
    ]


@pytest.mark.parametrize("model", [CycleModel(), CycleModel(break_every=5)],
                         ids=["cycle", "broken-cycle"])
def test_speculation_gives_plain_decodings_tokens_and_frees_every_block(model) -> None:
    plain, plain_reasons, s0 = run_core(requests(), model)
    spec, spec_reasons, s1 = run_core(requests(), model, speculative="ngram",
                                      num_speculative_tokens=4)
    assert spec == plain and spec_reasons == plain_reasons
    assert len(plain["long"]) == 40 and len(plain["short"]) == 3
    assert plain_reasons["stop-id"] == "stop" and len(plain["stop-id"]) > 9  # min_tokens
    assert s0.stats.spec_draft_tokens == 0
    assert s1.stats.spec_accepted_tokens > 0
    assert s1.stats.spec_accepted_tokens <= s1.stats.spec_draft_tokens
    assert s1.stats.steps < s0.stats.steps  # accepted drafts saved steps
    assert s1.stats.generated_tokens == s0.stats.generated_tokens
    assert s1.kv.num_free_blocks == s1.kv.num_total_blocks
    s1.check_integrity()


class DecoyModel(CycleModel):
    """Emits A B x A B y A B z ... with x, y, z never seen before: after every "A B" the
    proposer drafts the token that followed the previous "A B", and it is always wrong."""

    def next_token(self, token: int, pos: int) -> int:
        return (50, 51, 1000 + pos)[pos % 3]


def test_rejected_drafts_give_their_blocks_back_and_are_never_cached() -> None:
    model = DecoyModel()
    kv = KVCacheManager(32, block_size=4)
    sched = Scheduler(SchedulerConfig(speculative="ngram", num_speculative_tokens=6), kv,
                      debug_checks=True)
    req = Request("r", [7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0))
    sched.add_request(req)
    drafted = 0
    while sched.has_unfinished():
        step = sched.schedule()
        seq = step.seqs[0]
        drafted += len(seq.draft_token_ids)
        sched.update(step, model.execute(step))
        if not req.is_finished:
            assert len(req.block_ids) <= -(-req.num_tokens // 4)  # nothing past the tokens
            assert req.num_computed_tokens == req.num_tokens - 1
    assert drafted > 0 and sched.stats.spec_accepted_tokens == 0
    # Every cached block's hash chain matches the tokens really generated.
    probe = Request("again", list(req.token_ids), SamplingParams(max_tokens=1))
    _, hit = kv.get_computed_blocks(probe)
    assert hit == (len(req.token_ids) - 1) // 4 * 4


def test_speculation_never_preempts_and_respects_the_token_budget() -> None:
    model = CycleModel()
    reqs = [Request(f"r{i}", [10 + i, 11 + i, 12 + i], SamplingParams(max_tokens=24,
                                                                    temperature=0.0))
            for i in range(6)]
    plain, _, s0 = run_core([Request(r.request_id, r.prompt_token_ids, r.sampling)
                             for r in reqs], model, num_blocks=24)
    spec, _, s1 = run_core(reqs, model, num_blocks=24, speculative="ngram",
                           num_speculative_tokens=8)
    assert spec == plain
    assert s1.stats.preemptions <= s0.stats.preemptions


def test_speculation_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="speculative"):
        SchedulerConfig(speculative="draft-model").validate()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(speculative="ngram", num_speculative_tokens=0).validate()


# -- the engine on the tiny model -------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from batcher.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer()


def tiny_engine(loaded, tokenizer, speculative: str):
    from batcher.engine.engine import AsyncEngine
    from batcher.runtime.model_runner import ModelRunner

    runner = ModelRunner(loaded, num_blocks=128, block_size=16)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, speculative=speculative)
    return AsyncEngine(runner, tokenizer, cfg, debug_checks=True)


async def generate_all(loaded, tokenizer, speculative: str, prompts, sp, stop=None):
    engine = tiny_engine(loaded, tokenizer, speculative)
    results = []
    try:
        for i, p in enumerate(prompts):  # one at a time: single-stream decoding
            toks, lps, text, reason = [], [], "", None
            async for ev in engine.generate(Request(f"r{i}", p, sp), stop=stop):
                toks += ev.token_ids
                lps += [None if lp is None else lp.logprob for lp in ev.logprobs]
                text += ev.text
                reason = ev.finish_reason or reason
            results.append((toks, lps, text, reason))
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        return results, engine.scheduler.stats
    finally:
        await engine.stop()


TINY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(300, 340)), [42] * 12]


def same_outputs(spec, plain) -> None:
    """Tokens, text and finish reasons equal; logprobs equal up to float rounding (a drafted
    position's logits come from a multi-token row, a plain one's from a one-token row)."""
    assert [(t, x, r) for t, _, x, r in spec] == [(t, x, r) for t, _, x, r in plain]
    for (_, a, _, _), (_, b, _, _) in zip(spec, plain, strict=True):
        assert a == pytest.approx(b, abs=1e-3)


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    # Seeded rows draw the same noise per output position with or without drafts; the bias
    # keeps the random model's samples among a few tokens, so drafts get proposed.
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True,
                   logprobs=2, presence_penalty=0.2,
                   logit_bias={5: 9.0, 6: 9.0, 7: 9.0, 8: 9.0}),
], ids=["greedy", "seeded-sampling"])
def test_tiny_engine_output_equals_plain_decoding(tiny_fp32, tokenizer, sp) -> None:
    plain, _ = asyncio.run(generate_all(tiny_fp32, tokenizer, "none", TINY_PROMPTS, sp))
    spec, stats = asyncio.run(generate_all(tiny_fp32, tokenizer, "ngram", TINY_PROMPTS, sp))
    same_outputs(spec, plain)
    assert stats.spec_accepted_tokens > 0


class CopyModel(CycleModel):
    """Continues its prompt cyclically (the token after t is the one after t in the prompt): an
    answer that repeats its prompt, so drafts from the prompt are accepted in long runs. A
    runner for the engine: it needs no tensors."""

    num_blocks = 64
    block_size = 16

    def __init__(self, prompt: list[int]) -> None:
        super().__init__()
        self.after = {t: prompt[(i + 1) % len(prompt)] for i, t in enumerate(prompt)}

    def next_token(self, token: int, pos: int) -> int:
        return self.after[token]


async def copy_engine_run(tokenizer, prompt, speculative: str, sp: SamplingParams, stop):
    from batcher.engine.engine import AsyncEngine

    engine = AsyncEngine(CopyModel(prompt), tokenizer,
                         SchedulerConfig(speculative=speculative), debug_checks=True)
    toks, text, reason, usage, groups = [], "", None, None, []
    try:
        async for ev in engine.generate(Request("c", prompt, sp), stop=stop):
            toks += ev.token_ids
            groups.append(len(ev.token_ids))
            text += ev.text
            if ev.finished:
                reason, usage = ev.finish_reason, ev.num_output_tokens
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        return (toks, text, reason, usage), groups
    finally:
        await engine.stop()


@pytest.mark.parametrize("max_tokens", [40, 6], ids=["stop", "stop-before-length"])
def test_stop_string_inside_a_drafted_span_ends_where_plain_decoding_does(tokenizer,
                                                                        max_tokens) -> None:
    """The stop string completes in the middle of a step's accepted drafts: the tokens after
    it are dropped, and the reason is "stop" even when the step also reached max_tokens."""
    prompt = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta iota kappa",
                        add_special_tokens=False)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stop = [" delta"]
    plain, plain_groups = asyncio.run(copy_engine_run(tokenizer, prompt, "none", sp, stop))
    spec, spec_groups = asyncio.run(copy_engine_run(tokenizer, prompt, "ngram", sp, stop))
    assert spec == plain
    assert plain[2] == "stop" and plain[1].endswith("gamma"), plain
    assert set(plain_groups) <= {0, 1} and max(spec_groups) > 1  # drafts were accepted


# -- the bundled model ------------------------------------------------------------------------


@pytest.mark.benchmark
def test_bundled_model_greedy_output_equals_plain_decoding(smollm_fp32, tokenizer) -> None:
    """SmolLM2 in fp32 (in bf16 a drafted position's logits, computed in a multi-token row, may
    round differently from a one-token row and flip a near-tie: see BENCHMARKS.md): the same
    tokens with and without drafts, and drafts accepted on an answer that repeats its prompt."""
    code = ("def area(width, height):\n    result = width * height\n    return result\n\n"
            "def perimeter(width, height):\n    result = 2 * (width + height)\n"
            "    return result\n")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in (
        f"Repeat this code exactly, renaming `result` to `value`:\n\n{code}",
        "Name three colours and one fruit of each colour.",
    )] + [tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8,")]
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    plain, _ = asyncio.run(generate_all(smollm_fp32, tokenizer, "none", prompts, sp))
    spec, stats = asyncio.run(generate_all(smollm_fp32, tokenizer, "ngram", prompts, sp))
    same_outputs(spec, plain)
    assert stats.spec_accepted_tokens >= 10, stats
