"""Scheduler with fake runners: chunked prefill, prefix hits, preemption, abort, stop rules, and a
randomized run that checks the pool after every step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batcher.core.config import SchedulerConfig
from batcher.core import kv_cache_manager
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.outputs import RunnerOutput, SchedulerOutput
from batcher.core.scheduler import Scheduler
from batcher.core.step_updates import RequestUpdate
from batcher.core.request import Priority, Request, RequestStatus
from batcher.core.sampling import SamplingParams

Runner = Callable[[SchedulerOutput], RunnerOutput]
MASK = (1 << 64) - 1


def make_sched(
    num_blocks: int = 256,
    block_size: int = 16,
    *,
    max_num_seqs: int = 16,
    budget: int = 256,
    max_model_len: int = 4096,
    threshold: int = 0,
    caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, threshold)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    ticks = iter(range(1_000_000))
    return Scheduler(cfg, kv, clock=lambda: float(next(ticks)), debug_checks=True)


def make_req(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    priority: int = Priority.INTERACTIVE,
    arrival: float = 0.0,
    eos: tuple[int, ...] = (),
    **sampling: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, prompt, sp, priority=priority, arrival_time=arrival, eos_token_ids=eos)


def fixed_runner(token: int = 7) -> Runner:
    """Samples `token` for every sequence whose chunk reaches its end."""

    def run(out: SchedulerOutput) -> RunnerOutput:
        ids = [s.request_id for s in out.seqs if s.sample]
        return RunnerOutput(ids, [token] * len(ids), [None] * len(ids))

    return run


def _mix(prev: int, token: int) -> int:
    return (prev * 6364136223846793005 + token * 1442695040888963407 + 1) & MASK


class PagedFakeModel:
    """Emulates a paged KV cache: the value stored at a position mixes the previous position's
    value (read back through the block table) with the token, and the next token comes from the
    last value. A wrong prefix hit, a stale block or a bad block table changes the tokens."""

    def __init__(self, kv: KVCacheManager, vocab: int = 1000) -> None:
        self.kv, self.vocab, self.bs = kv, vocab, kv.block_size
        self.memory: dict[int, int] = {}

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        for seq in out.seqs:
            assert len(seq.block_ids) * self.bs >= seq.start_pos + seq.num_tokens
            for j, tok in enumerate(seq.token_ids):
                pos = seq.start_pos + j
                # A block being written belongs to this sequence alone.
                assert self.kv.pool.blocks[seq.block_ids[pos // self.bs]].ref_count == 1
                prev = self.memory[self._slot(seq.block_ids, pos - 1)] if pos else 0
                self.memory[self._slot(seq.block_ids, pos)] = _mix(prev, tok)
            if seq.sample:
                last = self.memory[self._slot(seq.block_ids, seq.start_pos + seq.num_tokens - 1)]
                result.request_ids.append(seq.request_id)
                result.token_ids.append(self.next_token(last))
                result.logprobs.append(None)
        return result

    def next_token(self, value: int) -> int:
        return (value >> 33) % self.vocab

    def expected_output(self, req: Request) -> list[int]:
        """What an unpaged model would generate for the request's own tokens."""
        value, values = 0, []
        for tok in req.token_ids:
            value = _mix(value, tok)
            values.append(value)
        n = req.num_prompt_tokens
        return [self.next_token(values[n - 1 + i]) for i in range(req.num_output_tokens)]


def step(sched: Scheduler, runner: Runner) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    out = sched.schedule()
    return out, sched.update(out, runner(out))


def run_to_end(sched: Scheduler, runner: Runner, max_steps: int = 10_000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished():
            return n
        step(sched, runner)
    raise AssertionError("did not finish")


def assert_pool_idle(sched: Scheduler) -> None:
    c = sched.kv.pool.counts()
    assert c.used == 0 and c.free + c.cached == sched.kv.num_total_blocks
    sched.kv.check_integrity()


def test_mixed_prefill_and_decode_in_one_step() -> None:
    sched, run = make_sched(), fixed_runner()
    a = make_req("a", list(range(10)))
    sched.add_request(a)
    out, ups = step(sched, run)
    assert [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.seqs] == [
        ("a", 0, 10, True)
    ]
    assert ups[0].new_token_ids == [7] and a.num_computed_tokens == 10
    sched.add_request(make_req("b", list(range(20))))
    out, _ = step(sched, run)
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in out.seqs] == [
        ("a", 10, 1),
        ("b", 0, 20),
    ]
    assert out.seqs[0].is_decode and out.seqs[0].output_index == 1
    assert out.num_batched_tokens == 21


def test_chunked_prefill_of_2000_tokens_under_a_256_token_budget() -> None:
    sched, run = make_sched(budget=256), fixed_runner()
    big = make_req("big", list(range(2000)), max_tokens=2)
    sched.add_request(big)
    chunks = []
    while big.num_output_tokens == 0:
        out, _ = step(sched, run)
        chunks += [(s.start_pos, s.num_tokens, s.sample) for s in out.seqs]
    assert [c[0] for c in chunks] == list(range(0, 2000, 256))
    assert chunks[-1] == (1792, 208, True) and not any(c[2] for c in chunks[:-1])
    assert len(chunks) == 8 and sched.stats.prompt_tokens_computed == 2000
    run_to_end(sched, run)
    assert big.status is RequestStatus.FINISHED_LENGTH and big.num_output_tokens == 2


def test_decodes_keep_flowing_while_a_long_prompt_is_chunked() -> None:
    sched, run = make_sched(budget=256, threshold=0), fixed_runner()
    for i in range(3):
        sched.add_request(make_req(f"d{i}", [1, 2, 3], max_tokens=50, priority=Priority.BATCH))
    step(sched, run)
    # An interactive prompt sorts ahead of the batch decodes but leaves them their tokens.
    sched.add_request(make_req("big", list(range(2000)), priority=Priority.INTERACTIVE, arrival=9))
    for _ in range(8):
        out, _ = step(sched, run)
        assert [s.request_id for s in out.seqs if s.is_decode] == ["d0", "d1", "d2"]
        assert out.num_batched_tokens <= 256
    assert sched.get_request("big").num_output_tokens == 1  # type: ignore[union-attr]


def _put_running(sched: Scheduler, req: Request, computed: int, outputs: tuple[int, ...] = ()
                 ) -> None:
    """Place `req` in `running` as if earlier steps had computed `computed` of its tokens and
    sampled `outputs`."""
    sched.add_request(req)
    sched.waiting.remove(req)
    req.token_ids += list(outputs)
    assert sched.kv.allocate_slots(req, computed)
    req.num_computed_tokens = computed
    req.status = RequestStatus.RUNNING
    sched.running.append(req)


def test_each_chunk_leaves_one_token_for_every_decode_behind_it() -> None:
    """Streams and prompts interleaved in `running` (A, P1, B, P2, C by arrival): each prompt's
    chunk leaves a token of the budget for each decode still behind it, and only those."""
    sched = make_sched(budget=20, caching=False)
    decode = {name: make_req(name, [1, 2, 3, 4], 8, arrival=t)
              for name, t in (("A", 0.0), ("B", 2.0), ("C", 4.0))}
    p1 = make_req("P1", list(range(100, 130)), 8, arrival=1.0)
    p2 = make_req("P2", list(range(200, 240)), 8, arrival=3.0)
    for req in sorted([*decode.values(), p1, p2], key=lambda r: r.arrival_time):
        if req in (p1, p2):
            _put_running(sched, req, 25 if req is p1 else 0)
        else:
            _put_running(sched, req, 4, outputs=(9,))
    rows = {s.request_id: len(s.token_ids) for s in sched.schedule().seqs}
    # A takes 1 (19 left); P1 its last 5, leaving B and C theirs (14); B 1 (13); P2 all but
    # C's token (12); C the last one.
    assert rows == {"A": 1, "P1": 5, "B": 1, "P2": 12, "C": 1}


def test_long_prefill_threshold_splits_budget_across_prompts() -> None:
    sched, run = make_sched(budget=256, threshold=64), fixed_runner()
    for rid in "abc":
        sched.add_request(make_req(rid, list(range(100))))
    out, _ = step(sched, run)
    assert [(s.request_id, s.num_tokens) for s in out.seqs] == [("a", 64), ("b", 64), ("c", 64)]
    out, _ = step(sched, run)
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in out.seqs] == [
        ("a", 64, 36),
        ("b", 64, 36),
        ("c", 64, 36),
    ]


def test_prefix_hit_skips_computed_tokens_and_keeps_outputs_exact() -> None:
    sched = make_sched(block_size=16)
    model = PagedFakeModel(sched.kv)
    prefix = list(range(500, 564))  # 64 tokens = 4 blocks
    a = make_req("a", prefix + [1] * 10, max_tokens=5)
    sched.add_request(a)
    run_to_end(sched, model)
    b = make_req("b", prefix + [2] * 7, max_tokens=5)
    sched.add_request(b)
    out, _ = step(sched, model)
    assert (out.seqs[0].start_pos, out.seqs[0].num_tokens) == (64, 7)
    assert b.num_cached_tokens == 64 and sched.stats.prefix_hit_tokens == 64
    run_to_end(sched, model)
    for r in (a, b):
        assert r.output_token_ids == model.expected_output(r)
    assert_pool_idle(sched)


@pytest.mark.parametrize(("prompt_len", "start"), [(64, 48), (70, 64)])
def test_a_full_prompt_hit_still_computes_a_token(prompt_len: int, start: int) -> None:
    sched = make_sched(block_size=16)
    model = PagedFakeModel(sched.kv)
    prompt = list(range(300, 300 + prompt_len))
    first = make_req("first", prompt, max_tokens=3)
    sched.add_request(first)
    run_to_end(sched, model)
    again = make_req("again", prompt, max_tokens=3)
    sched.add_request(again)
    out, _ = step(sched, model)
    assert out.seqs[0].start_pos == start and out.seqs[0].sample
    assert again.num_cached_tokens == start
    run_to_end(sched, model)
    assert again.output_token_ids == first.output_token_ids == model.expected_output(first)


def test_hash_collisions_never_serve_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, toks: b"\x00" * 16)
    sched = make_sched(block_size=4)
    model = PagedFakeModel(sched.kv)
    reqs = [make_req("x", list(range(16)), 4), make_req("y", list(range(16, 32)), 4)]
    reqs.append(make_req("x2", list(range(16)) + [5], 4))
    reqs.append(make_req("x3", list(range(4)) + list(range(20, 32)), 4))
    for r in reqs:
        sched.add_request(r)
        run_to_end(sched, model)
    assert reqs[1].num_cached_tokens == 0
    for r in reqs:
        assert r.output_token_ids == model.expected_output(r)
    assert_pool_idle(sched)


def _three_way(num_blocks: int) -> tuple[Scheduler, PagedFakeModel, list[Request]]:
    sched = make_sched(num_blocks, block_size=4, budget=64)
    model = PagedFakeModel(sched.kv)
    reqs = [
        make_req("old", [1, 2, 3, 4], 12, priority=Priority.INTERACTIVE, arrival=0),
        make_req("batch", [5, 6, 7, 8], 12, priority=Priority.BATCH, arrival=1),
        make_req("new", [9, 10, 11, 12], 12, priority=Priority.INTERACTIVE, arrival=2),
    ]
    for r in reqs:
        sched.add_request(r)
    return sched, model, reqs


def test_preemption_takes_lowest_priority_then_newest_and_recomputes_exactly() -> None:
    sched, model, reqs = _three_way(num_blocks=6)
    victims: list[str] = []
    while sched.has_unfinished():
        before = sched.stats.preemptions
        out, _ = step(sched, model)
        if sched.stats.preemptions > before:
            victims += [rid for rid in out.freed_ids if sched.get_request(rid) is not None]
            assert sched.waiting[0].request_id == victims[-1]  # back at the head
            assert {s.request_id for s in out.seqs}.isdisjoint(victims[-1:])
    assert victims[:2] == ["batch", "new"]
    big, big_model, big_reqs = _three_way(num_blocks=64)
    run_to_end(big, big_model)
    assert big.stats.preemptions == 0 and sched.stats.preemptions >= 2
    for r, ref in zip(reqs, big_reqs, strict=True):
        assert r.output_token_ids == ref.output_token_ids == model.expected_output(r)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert reqs[1].num_preemptions >= 1
    assert_pool_idle(sched)


@pytest.mark.parametrize(
    ("big_priority", "late_arrival", "waiting_after"),
    [
        (Priority.BATCH, 2.0, ["late", "big"]),  # priority first
        (Priority.INTERACTIVE, 0.5, ["big", "late"]),  # then a preempted request at the head
    ],
)
def test_no_admission_in_a_step_that_preempted(
    big_priority: int, late_arrival: float, waiting_after: list[str]
) -> None:
    sched = make_sched(7, block_size=4, budget=64)
    run = fixed_runner()
    small = make_req("small", list(range(8)), 8, priority=Priority.INTERACTIVE, arrival=0)
    big = make_req("big", list(range(20)), 8, priority=big_priority, arrival=1)
    sched.add_request(small)
    sched.add_request(big)
    step(sched, run)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make_req("late", [1, 2, 3], 2, arrival=late_arrival))
    out, _ = step(sched, run)  # small needs a block: big is preempted
    assert big.status is RequestStatus.WAITING and "big" in out.freed_ids
    assert [s.request_id for s in out.seqs] == ["small"] and sched.kv.num_free_blocks >= 1
    assert [r.request_id for r in sched.waiting] == waiting_after
    run_to_end(sched, run)
    assert_pool_idle(sched)


def test_abort_frees_waiting_and_running_requests_at_the_next_schedule() -> None:
    sched, run = make_sched(max_num_seqs=1), fixed_runner()
    a, b, c = (make_req(rid, list(range(40)), 10) for rid in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert sched.abort("a") and sched.abort("c") and not sched.abort("nope")
    held = sched.kv.num_total_blocks - sched.kv.num_free_blocks
    assert held > 0 and a.status is RequestStatus.RUNNING  # the runner may still read them
    assert sched.update(out, run(out)) == []  # output of an aborted request is dropped
    out = sched.schedule()
    assert sorted(out.freed_ids) == ["a", "c"] and [s.request_id for s in out.seqs] == ["b"]
    # The requests themselves too, in the same order: an ID may name a new request by the time
    # the report is read.
    assert [r.request_id for r in out.freed] == out.freed_ids
    assert {id(r) for r in out.freed} == {id(a), id(c)}
    assert a.status is c.status is RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert sched.get_request("a") is None and not sched.abort("a")
    assert sched.num_running == 1 and sched.num_waiting == 0
    sched.update(out, run(out))
    assert sched.abort("b")
    assert sched.schedule().freed_ids == ["b"] and not sched.has_unfinished()
    assert_pool_idle(sched)


def test_finish_from_the_engine_frees_at_once() -> None:
    sched, run = make_sched(), fixed_runner()
    sched.add_request(make_req("a", list(range(40)), 10))
    step(sched, run)
    with pytest.raises(ValueError):
        sched.finish("a", RequestStatus.RUNNING)
    assert sched.finish("a", RequestStatus.FINISHED_STOPPED)
    assert not sched.finish("a", RequestStatus.FINISHED_ERROR)  # already gone
    assert_pool_idle(sched)
    assert sched.schedule().freed_ids == ["a"]


def _scripted(tokens: list[int]) -> Runner:
    it = iter(tokens)

    def run(out: SchedulerOutput) -> RunnerOutput:
        ids = [s.request_id for s in out.seqs if s.sample]
        return RunnerOutput(ids, [next(it) for _ in ids])

    return run


@pytest.mark.parametrize(
    ("kwargs", "tokens", "n_out", "reason"),
    [
        ({"eos": (2,)}, [5, 2, 5, 5], 2, "stop"),
        ({"eos": (2,), "ignore_eos": True}, [5, 2, 5, 5], 4, "length"),
        ({"stop_token_ids": [9]}, [5, 9, 5, 5], 2, "stop"),
        ({"stop_token_ids": [9], "ignore_eos": True}, [5, 9, 5, 5], 2, "stop"),
        ({"eos": (2,), "min_tokens": 2}, [2, 2, 2, 5], 3, "stop"),
        ({"stop_token_ids": [9], "min_tokens": 3}, [9, 9, 9, 5], 4, "length"),
        ({}, [5, 5, 5, 5], 4, "length"),
        ({"eos": (2,)}, [5, 5, 5, 2], 4, "stop"),  # a stop on the last allowed token is "stop"
    ],
)
def test_stop_rules(kwargs: dict, tokens: list[int], n_out: int, reason: str) -> None:
    sched = make_sched(max_model_len=64)
    req = make_req("r", [1, 2, 3], max_tokens=4, **kwargs)
    sched.add_request(req)
    run = _scripted(tokens)
    updates: list[RequestUpdate] = []
    while sched.has_unfinished():
        updates += step(sched, run)[1]
    assert req.output_token_ids == tokens[:n_out] and req.status.finish_reason == reason
    assert [u.finished for u in updates] == [False] * (n_out - 1) + [True]
    assert updates[-1].finish_reason == reason and updates[-1].status is req.status
    assert_pool_idle(sched)


def test_max_model_len_and_capacity_are_checked_at_add() -> None:
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="exceeds"):
        sched.add_request(make_req("long", list(range(30)), max_tokens=3))
    with pytest.raises(ValueError, match="KV"):
        sched.add_request(make_req("huge", list(range(16)), max_tokens=2))  # 17 slots > 16
    sched.add_request(make_req("fits", list(range(16)), max_tokens=1))  # 16 slots
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_req("fits", [1], max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_req("empty", [], max_tokens=1))
    with pytest.raises(ValueError):
        sched.add_request(make_req("bad", [1], max_tokens=0))
    assert sched.num_waiting == 1


def test_max_num_seqs_caps_the_batch_and_output_index_counts_outputs() -> None:
    sched, run = make_sched(max_num_seqs=2), fixed_runner()
    for rid in "abc":
        sched.add_request(make_req(rid, [1, 2], 3))
    out, _ = step(sched, run)
    assert [s.request_id for s in out.seqs] == ["a", "b"] and sched.num_waiting == 1
    out, _ = step(sched, run)
    assert [(s.request_id, s.output_index) for s in out.seqs] == [("a", 1), ("b", 1)]
    assert run_to_end(sched, run) > 0 and sched.stats.generated_tokens == 9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_randomized_run_keeps_the_pool_consistent(data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(3, 24), label="num_blocks")
    sched = make_sched(
        num_blocks,
        bs,
        max_num_seqs=data.draw(st.integers(1, 6)),
        budget=data.draw(st.integers(1, 40)),
        max_model_len=64,
        threshold=data.draw(st.integers(0, 12)),
        caching=data.draw(st.booleans()),
    )
    model = PagedFakeModel(sched.kv, vocab=12)
    bases = [[7] * 20, list(range(20)), list(range(40, 60))]
    reqs: list[Request] = []
    for t in range(data.draw(st.integers(1, 40), label="steps")):
        for _ in range(data.draw(st.integers(0, 2))):
            base = data.draw(st.sampled_from(bases))
            prompt = base[: data.draw(st.integers(1, 20))] + data.draw(
                st.lists(st.integers(0, 11), max_size=4)
            )
            req = make_req(
                f"r{len(reqs)}",
                prompt,
                data.draw(st.integers(1, 8)),
                priority=data.draw(st.sampled_from(list(Priority))),
                arrival=float(t),
                eos=(0,),
                ignore_eos=data.draw(st.booleans()),
            )
            try:
                sched.add_request(req)
            except ValueError:
                assert (
                    sched.kv.blocks_needed(req.num_tokens + req.sampling.max_tokens - 1)
                    > num_blocks
                )
                continue
            reqs.append(req)
        if reqs and data.draw(st.integers(0, 4)) == 0:
            sched.abort(data.draw(st.sampled_from(reqs)).request_id)
        if reqs and data.draw(st.integers(0, 9)) == 0:
            sched.finish(data.draw(st.sampled_from(reqs)).request_id, RequestStatus.FINISHED_ERROR)
        step(sched, model)  # debug_checks asserts the invariants after schedule and update
    run_to_end(sched, model, max_steps=5_000)
    assert_pool_idle(sched)
    for r in reqs:
        assert r.is_finished and r.block_ids == []
        assert r.output_token_ids == model.expected_output(r)
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling.max_tokens
        elif r.status is RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] == 0 and not r.sampling.ignore_eos
