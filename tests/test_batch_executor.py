"""The batch executor over a fake line runner: completion and output files, retries of refused
lines, the capacity gate, cancel, expiry, and resuming a batch after a stop without running an
answered line twice."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from batcher.batch.executor import BatchExecutor
from batcher.batch.jsonl import parse_input
from batcher.batch.lines import Deferred, LineResult
from batcher.batch.metrics import BatchMetrics
from batcher.batch.store import BatchStore
from batcher.http.errors import error_body
from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig

pytestmark = pytest.mark.timeout(30)


class FakeRunner:
    """Answers `{"echo": prompt}` after `delay`; `fail` lines get a 400; `defer` lines are
    refused for now once."""

    def __init__(self, delay: float = 0.01):
        self.delay = delay
        self.calls: collections.Counter[str] = collections.Counter()
        self.finished: collections.Counter[str] = collections.Counter()
        self.deferred: set[str] = set()
        self.running = self.peak = 0
        self.prefilling: set[str] = set()  # request ids of lines still "in prefill"
        self.prefill_s = 0.0
        self.left: dict[str, int] = {}  # request id -> decode steps to go, while decoding
        self.decode_steps = 16

    def in_prefill(self, rid: str) -> bool:
        return rid in self.prefilling

    def steps_left(self, rid: str) -> int | None:
        return self.left.get(rid)

    async def run(self, tenant: TenantConfig, url: str, body: dict, rid: str) -> LineResult:
        p = body["prompt"]
        self.calls[p] += 1
        if body.get("defer") and p not in self.deferred:
            self.deferred.add(p)
            raise Deferred(0.05, "queue_full")
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if self.prefill_s:
                self.prefilling.add(rid)
                try:
                    await asyncio.sleep(self.prefill_s)
                finally:
                    self.prefilling.discard(rid)
            self.left[rid] = self.decode_steps
            await asyncio.sleep(self.delay)
        finally:
            self.left.pop(rid, None)
            self.running -= 1
        self.finished[p] += 1
        if body.get("fail"):
            return LineResult(400, error_body(400, "bad line", code="invalid_value"))
        return LineResult(200, {"echo": p}, tokens=3)


class FakeGate:
    def __init__(self, cap: int = 4):
        self.cap = cap
        self.open = True
        self.interactive = False
        self.shedding = False
        self.last_reason = ""
        self.last_code = ""
        self.last_predicted_s: float | None = None
        self.seen: list[tuple[int, int, int]] = []

    def interactive_waiting(self) -> bool:
        return self.interactive

    def shed(self) -> bool:
        return self.shedding

    def room(self, in_flight: int, prompt_tokens: int, max_tokens: int, lines: int = 1
             ) -> bool:
        self.seen.append((in_flight, prompt_tokens, lines))
        return self.open and in_flight < self.cap


def lines_file(n: int, **extra: Any) -> bytes:
    return b"\n".join(orjson.dumps({"custom_id": f"c{i}", "url": "/v1/completions",
                                    "body": {"model": "m", "prompt": f"p{i}", **(
                                        extra if i % 3 == 0 else {})}})
                      for i in range(n))


class Rig:
    def __init__(self, tmp: Path, runner: FakeRunner, gate: FakeGate, clock: list[float]):
        self.store = BatchStore(tmp, clock=lambda: clock[0])
        self.runner = runner
        self.gate = gate
        self.metrics = BatchMetrics()
        self.ex = BatchExecutor(self.store, runner, gate, self.tenant, self.metrics,
                                wall_clock=lambda: clock[0], tick_s=0.01)

    @staticmethod
    def tenant(name: str) -> TenantConfig | None:
        return DEFAULT_TENANT if name == DEFAULT_TENANT.name else None

    def create(self, data: bytes, window_s: float = 3600.0) -> str:
        temp = self.store.temp_path()
        temp.write_bytes(data)
        f = self.store.add_file("default", "in.jsonl", "batch", temp, len(data))
        lines, problems = parse_input(data)
        assert not problems
        rec = self.store.create_batch("default", "/v1/completions", f.id, "1h", window_s, None,
                                      lines)
        self.ex.add(rec)
        return rec.id

    async def wait(self, batch_id: str, within: float = 10.0):
        deadline = time.monotonic() + within
        while True:
            rec = self.store.batch(batch_id)
            assert rec is not None
            if rec.status in ("completed", "cancelled", "expired", "failed"):
                return rec
            assert time.monotonic() < deadline, f"batch still {rec.status}"
            await asyncio.sleep(0.01)

    def read(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        return [orjson.loads(x) for x in self.store.path(file_id).read_bytes().splitlines()]


@pytest.fixture
def clock() -> list[float]:
    return [1000.0]


async def test_batch_completes_with_output_and_error_files(tmp_path: Path,
                                                           clock: list[float]) -> None:
    rig = Rig(tmp_path, FakeRunner(), FakeGate(cap=3), clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(10, fail=True))
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.status == "completed" and (rec.total, rec.completed, rec.failed) == (10, 6, 4)
    out, err = rig.read(rec.output_file_id), rig.read(rec.error_file_id)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(10) if i % 3]
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
    assert out[0]["response"]["body"] == {"echo": "p1"} and out[0]["id"].startswith("batch_req_")
    assert [x["custom_id"] for x in err] == ["c0", "c3", "c6", "c9"]
    assert err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["code"] == "invalid_value"
    assert rig.runner.peak <= 3
    assert rig.metrics.tokens._value.get() == 18
    assert rig.metrics.done.labels("ok")._value.get() == 6
    assert rig.store.active_batches() == [] and list(rig.store.outputs(bid)) == []


async def test_output_files_are_written_without_holding_every_answer(
        tmp_path: Path, clock: list[float]) -> None:
    """Answers go from the store to the files line by line: finalizing 16 MB of answers holds
    a few buffers, not the whole output (a large batch's output can be gigabytes)."""
    import tracemalloc

    rig = Rig(tmp_path, FakeRunner(), FakeGate(), clock)  # not started: lines answered here
    n, big = 128, "x" * (128 * 1024)
    bid = rig.create(lines_file(n))
    for i in range(n - 2):  # the last two never answered: the error file's unanswered lines
        rig.store.record_result(bid, i, 200 if i % 4 else 400,
                                orjson.dumps({"custom_id": f"c{i}", "big": big}), 1)
    total = n * len(big)
    tracemalloc.start()
    try:
        await rig.ex._finalize(rig.ex.batches[bid], "expired")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < total / 4, (peak, total)
    rec = rig.store.batch(bid)
    assert rec is not None and rec.status == "expired"
    out, err = rig.read(rec.output_file_id), rig.read(rec.error_file_id)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(n - 2) if i % 4]
    assert all(x["big"] == big for x in out)
    assert [x["custom_id"] for x in err] == [f"c{i}" for i in range(0, n - 2, 4)] + [
        f"c{n - 2}", f"c{n - 1}"]
    assert err[-1]["error"]["code"] == "batch_expired"
    assert not list(tmp_path.rglob(".tmp-*"))  # nothing left behind


async def test_refused_lines_run_again_later(tmp_path: Path, clock: list[float]) -> None:
    rig = Rig(tmp_path, FakeRunner(), FakeGate(), clock)
    await rig.ex.start()
    try:
        rec = await rig.wait(rig.create(lines_file(6, defer=True)))
    finally:
        await rig.ex.stop()
    assert rec.status == "completed" and rec.completed == 6
    assert rig.runner.calls["p0"] == 2 and rig.runner.finished["p0"] == 1
    assert rig.metrics.deferrals.labels("queue_full")._value.get() == 2


async def test_no_line_starts_while_the_gate_is_shut(tmp_path: Path,
                                                     clock: list[float]) -> None:
    gate = FakeGate()
    gate.open = False
    gate.last_code, gate.last_predicted_s = "ttft", 1.5
    rig = Rig(tmp_path, FakeRunner(), gate, clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(4))
        await asyncio.sleep(0.2)
        assert sum(rig.runner.calls.values()) == 0
        assert rig.metrics.queued._value.get() == 4
        # Why nothing starts is exported: what blocked, and the gate's prediction.
        assert rig.metrics.gate_blocked.labels("ttft")._value.get() >= 1
        assert rig.metrics.gate_predicted._value.get() == 1.5
        gate.open = True
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.completed == 4


async def test_cancel_answers_every_line_exactly_once(tmp_path: Path,
                                                      clock: list[float]) -> None:
    rig = Rig(tmp_path, FakeRunner(delay=0.05), FakeGate(cap=2), clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(20))
        while sum(rig.runner.finished.values()) < 4:
            await asyncio.sleep(0.01)
        assert rig.store.set_status(bid, "cancelling", ("in_progress",))
        rig.ex.cancel(bid)
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.status == "cancelled" and rec.cancelled_at is not None
    out, err = rig.read(rec.output_file_id), rig.read(rec.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(f"c{i}" for i in range(20))
    assert len(out) == rec.completed >= 4
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert rec.completed + rec.failed == 20


async def test_expiry_keeps_the_finished_lines(tmp_path: Path, clock: list[float]) -> None:
    rig = Rig(tmp_path, FakeRunner(delay=0.05), FakeGate(cap=1), clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(30), window_s=60)
        while sum(rig.runner.finished.values()) < 3:
            await asyncio.sleep(0.01)
        clock[0] += 61
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.status == "expired" and rec.expired_at == 1061
    out, err = rig.read(rec.output_file_id), rig.read(rec.error_file_id)
    assert 3 <= len(out) < 30 and len(out) + len(err) == 30
    assert {x["error"]["code"] for x in err} == {"batch_expired"}
    assert all(x["response"]["body"] == {"echo": "p" + x["custom_id"][1:]} for x in out)


async def test_a_stopped_batch_resumes_without_rerunning_answered_lines(
        tmp_path: Path, clock: list[float]) -> None:
    runner = FakeRunner(delay=0.05)
    first = Rig(tmp_path, runner, FakeGate(cap=3), clock)
    await first.ex.start()
    bid = first.create(lines_file(15))
    while sum(runner.finished.values()) < 5:
        await asyncio.sleep(0.005)
    await first.ex.stop()  # lines in flight end unanswered, as in a crash
    first.store.close()
    peek = BatchStore(tmp_path)
    answered = {c for c, s, o in peek.outputs(bid) if o is not None}
    peek.close()
    assert 5 <= len(answered) < 15

    second = Rig(tmp_path, runner, FakeGate(cap=3), clock)
    await second.ex.start()
    try:
        rec = await second.wait(bid)
    finally:
        await second.ex.stop()
    assert rec.status == "completed" and rec.completed == 15
    out = second.read(rec.output_file_id)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(15)]
    # An answered line never ran again; every other line ran to its answer once.
    for i in range(15):
        assert runner.finished[f"p{i}"] == 1
        assert runner.calls[f"p{i}"] == 1 or f"c{i}" not in answered


async def test_lines_started_together_are_checked_together(tmp_path: Path,
                                                           clock: list[float]) -> None:
    gate = FakeGate(cap=3)
    rig = Rig(tmp_path, FakeRunner(delay=0.2), gate, clock)
    await rig.ex.start()
    try:
        rec = await rig.wait(rig.create(lines_file(3)))
    finally:
        await rig.ex.stop()
    assert rec.completed == 3
    # One pass started all three: each check saw the lines before it, prompts summed.
    first = gate.seen[:3]
    assert [(f, n) for f, _, n in first] == [(0, 1), (1, 2), (2, 3)]
    assert first[0][1] < first[1][1] < first[2][1]


async def test_lines_in_prefill_make_way_for_interactive_requests(
        tmp_path: Path, clock: list[float]) -> None:
    runner = FakeRunner(delay=0.05)
    runner.prefill_s = 0.3
    gate = FakeGate(cap=4)
    rig = Rig(tmp_path, runner, gate, clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(8))
        while len(runner.prefilling) < 4:
            await asyncio.sleep(0.005)
        gate.interactive = True  # an interactive request is queued: no starts, and yield
        gate.open = False
        while runner.prefilling:
            await asyncio.sleep(0.005)
        assert rig.ex.in_flight == 0 and sum(runner.finished.values()) == 0
        assert rig.metrics.deferrals.labels("yield")._value.get() == 4
        gate.interactive = False
        gate.open = True
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.completed == 8
    out = rig.read(rec.output_file_id)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(8)]
    assert all(runner.finished[f"p{i}"] == 1 for i in range(8))
    assert all(runner.calls[f"p{i}"] == 2 for i in range(4))  # the yielded ones ran again


async def test_decoding_lines_make_way_unless_about_to_finish(
        tmp_path: Path, clock: list[float]) -> None:
    runner = FakeRunner(delay=0.3)
    gate = FakeGate(cap=2)
    rig = Rig(tmp_path, runner, gate, clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(4))
        while len(runner.left) < 2:
            await asyncio.sleep(0.005)
        a, b = sorted(runner.left)
        runner.left[a] = 2  # about to finish: it keeps its row
        gate.interactive = True  # an interactive request queued or prefilling
        gate.open = False
        while rig.ex.in_flight > 1:
            await asyncio.sleep(0.005)
        assert rig.metrics.deferrals.labels("yield")._value.get() == 1
        assert b not in runner.left and a in runner.left
        gate.interactive = False
        gate.open = True
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.completed == 4
    assert sum(runner.finished.values()) == 4 and sum(runner.calls.values()) == 5


async def test_running_lines_are_shed_newest_first_while_interactive_needs_room(
        tmp_path: Path, clock: list[float]) -> None:
    runner = FakeRunner(delay=0.5)
    gate = FakeGate(cap=3)
    rig = Rig(tmp_path, runner, gate, clock)
    await rig.ex.start()
    try:
        bid = rig.create(lines_file(5))
        while runner.running < 3:
            await asyncio.sleep(0.005)
        gate.open = False
        gate.shedding = True
        while rig.ex.in_flight > 1:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        # The newest two went back to the head of the batch, in order; the oldest keeps running.
        assert rig.metrics.deferrals.labels("shed")._value.get() == 2
        assert list(rig.ex.batches[bid].pending) == [1, 2, 3, 4]
        assert list(rig.ex.batches[bid].running) == [0]
        gate.shedding = False
        gate.open = True
        rec = await rig.wait(bid)
    finally:
        await rig.ex.stop()
    assert rec.completed == 5
    assert [x["custom_id"] for x in rig.read(rec.output_file_id)] == [f"c{i}" for i in range(5)]
    assert all(runner.finished[f"p{i}"] == 1 for i in range(5))


def costed(tag: str, n: int, cost: tuple[int, int]) -> list[Any]:
    from batcher.batch.jsonl import InputLine

    return [InputLine(i, f"{tag}{i}", "/v1/completions", {"model": "m", "prompt": f"{tag}{i}"},
                      cost=cost) for i in range(n)]


def create_for(rig: Rig, tenant: str, lines: list[Any]) -> str:
    rec = rig.store.create_batch(tenant, "/v1/completions", "file-x", "1h", 3600.0, None, lines)
    rig.ex.add(rec)
    return rec.id


class StartOrder(FakeRunner):
    def __init__(self, delay: float):
        super().__init__(delay)
        self.order: list[str] = []

    async def run(self, tenant: TenantConfig, url: str, body: dict, rid: str) -> LineResult:
        self.order.append(body["prompt"])
        return await super().run(tenant, url, body, rid)


async def test_tenants_take_turns(tmp_path: Path, clock: list[float]) -> None:
    runner = StartOrder(delay=0.05)
    rig = Rig(tmp_path, runner, FakeGate(cap=2), clock)
    rig.ex.tenants = lambda name: DEFAULT_TENANT
    a = create_for(rig, "a", costed("a", 8, (4, 4)))
    b = create_for(rig, "b", costed("b", 2, (4, 4)))
    await rig.ex.start()
    try:
        await rig.wait(a)
        await rig.wait(b)
    finally:
        await rig.ex.stop()
    # b's batch is younger, but its lines start in the first rounds, not after all of a's.
    assert sorted(runner.order[:4]) == ["a0", "a1", "b0", "b1"], runner.order


class SizedGate(FakeGate):
    """Refuses, as too big for the KV left ("kv"), any start past `max_prompt` tokens."""

    def __init__(self, cap: int, max_prompt: int):
        super().__init__(cap)
        self.max_prompt = max_prompt

    def room(self, in_flight: int, prompt_tokens: int, max_tokens: int, lines: int = 1
             ) -> bool:
        if not super().room(in_flight, prompt_tokens, max_tokens, lines):
            self.last_code = "cap"
            return False
        self.last_code = "kv" if prompt_tokens > self.max_prompt else "room"
        return self.last_code == "room"


async def test_a_line_too_big_for_now_holds_back_only_its_tenant(tmp_path: Path,
                                                                 clock: list[float]) -> None:
    runner = StartOrder(delay=0.01)
    gate = SizedGate(cap=4, max_prompt=100)
    rig = Rig(tmp_path, runner, gate, clock)
    rig.ex.tenants = lambda name: DEFAULT_TENANT
    big = create_for(rig, "a", costed("a", 1, (1000, 10)))
    small = create_for(rig, "b", costed("b", 5, (5, 5)))
    await rig.ex.start()
    try:
        assert (await rig.wait(small)).completed == 5
        assert "a0" not in runner.order  # still waiting for room
        assert rig.metrics.gate_blocked.labels("kv")._value.get() > 0
        gate.max_prompt = 10_000  # room at last
        assert (await rig.wait(big)).completed == 1
    finally:
        await rig.ex.stop()
    # Each line was sized by its stored cost, never by reading it.
    assert (0, 1000, 1) in gate.seen and (0, 5, 1) in gate.seen
