"""The spare-capacity gate: a batch line starts only when nothing interactive is queued, slots and
KV blocks stay free for interactive requests, and admission's TTFT prediction for an interactive
request arriving after the line stays within its share of the SLO."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batcher.admission.admission import Admission
from batcher.batch.gate import GateConfig, SpareCapacity
from batcher.core.config import SchedulerConfig
from batcher.core.kv_cache_manager import KVCacheManager
from batcher.core.scheduler import Scheduler
from batcher.core.request import Priority, Request


@dataclass
class Engine:
    """What the gate reads of the engine: health, the scheduler and the KV manager."""

    scheduler: Scheduler
    kv: KVCacheManager
    healthy: bool = True


def rig(slo_ttft_s: float | None = 2.0, num_blocks: int = 64, max_seqs: int = 16,
        max_running: int = 4, beside: int = 2
        ) -> tuple[SpareCapacity, Engine, Admission, list[float]]:
    now = [100.0]
    kv = KVCacheManager(num_blocks, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs), kv, clock=lambda: now[0])
    engine = Engine(sched, kv)
    adm = Admission(None, slo_ttft_s=slo_ttft_s, clock=lambda: now[0])
    gate = SpareCapacity(engine, adm,  # type: ignore[arg-type]
                         GateConfig(max_running=max_running, max_running_beside=beside),
                         clock=lambda: now[0])
    return gate, engine, adm, now


def add(engine: Engine, rid: str, prompt: int, priority: int) -> None:
    engine.scheduler.add_request(Request(rid, list(range(1, prompt + 1)), priority=priority))


def test_idle_engine_has_room() -> None:
    gate, *_ = rig()
    assert gate.room(0, 100, 32) and gate.last_reason == "room"


def test_queued_interactive_work_shuts_the_gate() -> None:
    gate, engine, *_ = rig(slo_ttft_s=None)
    add(engine, "batch", 10, Priority.BATCH)
    assert gate.room(0, 100, 32)  # queued batch work does not block more batch work
    add(engine, "live", 10, Priority.INTERACTIVE)
    assert not gate.room(0, 100, 32) and "interactive" in gate.last_reason
    engine.scheduler.schedule()  # it runs now, its prompt not yet computed: still pending
    assert gate.interactive_waiting() and not gate.room(0, 100, 32)


def test_cap_slots_blocks_and_health() -> None:
    gate, engine, _adm, _ = rig(max_seqs=8, max_running=3)
    assert not gate.room(3, 10, 10) and "cap" in gate.last_reason
    # 64 blocks of 16 tokens; a quarter stays free for interactive requests.
    assert gate.room(0, 700, 64)
    assert not gate.room(1, 800, 64) and "KV" in gate.last_reason
    assert not gate.room(0, 800, 64, lines=2) and "KV" in gate.last_reason
    # An idle engine lends one line the reserve: a line bigger than the pool less the reserve
    # would otherwise never start. Past the whole pool it still waits.
    assert gate.room(0, 800, 64)
    assert not gate.room(0, 1000, 64) and "KV" in gate.last_reason
    for i in range(7):
        add(engine, f"b{i}", 4, Priority.BATCH)
    assert not gate.room(0, 10, 10) and "slots" in gate.last_reason
    gate2, _engine2, adm2, _ = rig()
    adm2.set_draining(True)
    assert not gate2.room(0, 10, 10)
    engine.healthy = False
    assert not gate.room(0, 10, 10)


@pytest.mark.parametrize("rate, admits", [(10_000.0, True), (200.0, False)])
def test_the_ttft_prediction_decides(rate: float, admits: bool) -> None:
    gate, engine, adm, now = rig(slo_ttft_s=2.0)
    # Measured steps: `rate` prefill tokens per second of wall time.
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, int(rate * 0.1), True)
    add(engine, "b0", 8, Priority.BATCH)  # not idle: the prediction decides
    # An interactive request arriving after a 300-token line waits for that prefill: at 200
    # tokens/s that is over a second, past half the 2 s SLO.
    assert gate.room(0, 300, 16) is admits
    # What the executor exports: the prediction made, and the blocker's label.
    assert gate.last_predicted_s is not None and (gate.last_predicted_s > 1.0) is not admits
    assert gate.last_code == ("room" if admits else "ttft")
    if not admits:
        assert "SLO" in gate.last_reason


def test_without_an_slo_only_the_structure_decides() -> None:
    gate, _engine, adm, now = rig(slo_ttft_s=None)
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, 1, True)  # a very slow engine
    assert gate.room(0, 300, 16)


def test_lines_starting_together_count_their_slots() -> None:
    gate, *_ = rig(slo_ttft_s=None, max_seqs=8, max_running=8)
    assert gate.room(0, 10, 10, lines=7)  # an eighth of 8 slots (one) stays free
    assert not gate.room(0, 10, 10, lines=8) and "slots" in gate.last_reason


def test_one_line_may_always_start_on_an_idle_engine() -> None:
    gate, engine, adm, now = rig(slo_ttft_s=2.0)
    # Unmeasured: one line at a time, and only on an idle engine.
    assert gate.room(0, 300, 16)
    assert not gate.room(0, 600, 32, lines=2) and "no prediction" in gate.last_reason
    # A pessimistic prediction (measured while the engine was crowded) does not stop an idle
    # engine from running the one line whose steps will correct it.
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, 10, True)
    assert gate.room(0, 300, 16)
    add(engine, "b0", 50, Priority.BATCH)
    assert not gate.room(0, 300, 16) and "SLO" in gate.last_reason



@pytest.mark.parametrize("rate, sheds", [(10_000.0, False), (50.0, True)])
def test_shedding_follows_the_prediction(rate: float, sheds: bool) -> None:
    gate, _engine, adm, now = rig(slo_ttft_s=2.0)
    assert not gate.shed()  # nothing measured
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, max(1, int(rate * 0.1)), True)
    # 128 tokens of the next interactive prompt at 50 tokens/s: 2.6 s, past 0.8 of the SLO.
    assert gate.shed() is sheds
    assert not rig(slo_ttft_s=None)[0].shed()


def test_the_gate_follows_admissions_cut_of_the_slo_share() -> None:
    """Admission admits interactive requests within a share of the SLO that its controller cuts
    after misses; the gate's start and shed thresholds shrink with it, so batch never keeps
    running (or starting) while interactive requests predicted below its thresholds are
    refused."""
    gate, engine, adm, now = rig(slo_ttft_s=2.0, max_running=8)
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, 100, True)  # 1,000 prefill tokens/s
    add(engine, "b0", 8, Priority.BATCH)
    # About 0.5 s predicted for an arrival after a 300-token line: within half of 2 s.
    assert gate.room(0, 300, 16)
    assert 0.3 < gate.last_predicted_s < 1.0
    adm.limit.share = 0.3  # the floor: interactive admitted within 0.6 s only
    assert not gate.room(0, 300, 16) and gate.last_code == "ttft"
    add(engine, "b1", 600, Priority.BATCH)
    engine.scheduler.schedule()  # both running: their prefill is ahead of any arrival
    assert gate.shed()
    adm.limit.share = 0.85
    assert not gate.shed()


def test_running_batch_work_is_not_counted_ahead_of_an_arrival() -> None:
    """Batch lines give way when an interactive request arrives, so the gate predicts that
    arrival from the interactive work only (the new line's prompt still counted)."""
    gate, engine, adm, now = rig(slo_ttft_s=2.0, max_running=8)
    for _ in range(20):
        now[0] += 0.1
        adm.observe_step(0.1, 100, True)  # 1,000 prefill tokens/s
    for i in range(4):
        add(engine, f"b{i}", 200, Priority.BATCH)
    engine.scheduler.schedule()  # 800 batch prompt tokens running, still to compute
    assert gate.room(4, 50, 16) and gate.last_predicted_s < 0.5
    add(engine, "live", 600, Priority.INTERACTIVE)
    engine.scheduler.schedule()  # interactive work ahead does count (and is pending)
    assert not gate.room(4, 50, 16) and gate.last_code == "interactive_queued"


def test_beside_interactive_requests_fewer_lines_run() -> None:
    """While an interactive request runs, and for `RECENT_S` after, at most
    `max_running_beside` lines are in flight, started at most `starts_per_s_beside` a second;
    the full cap comes back after that."""
    from batcher.batch.gate import RECENT_S

    gate, engine, _adm, now = rig(slo_ttft_s=None, max_running=4, beside=2)
    gate.starts_per_s_beside = 10.0
    assert gate.room(2, 10, 10)  # nothing interactive: up to the full cap
    add(engine, "live", 1, Priority.INTERACTIVE)
    engine.scheduler.schedule()  # running; its one-token prompt is computed in this step
    sched = engine.scheduler
    live = sched.running[0]
    live.num_computed_tokens = live.num_tokens  # as after the step: decoding, not prefilling
    live.token_ids.append(7)
    live.num_computed_tokens = live.num_tokens - 1
    assert not gate.interactive_waiting()
    now[0] += 1.0
    assert gate.room(1, 10, 10)
    assert not gate.room(1, 10, 10) and gate.last_code == "beside"  # one start per 0.1 s
    now[0] += 0.1
    assert not gate.room(2, 10, 10) and gate.last_code == "beside"
    sched.abort("live")
    sched.schedule()  # freed
    now[0] += RECENT_S / 2
    assert not gate.room(2, 10, 10) and gate.last_code == "beside"  # seen a moment ago
    now[0] += RECENT_S
    assert gate.room(2, 10, 10) and gate.room(3, 10, 10)
    assert not gate.room(4, 10, 10) and gate.last_code == "cap"
    with pytest.raises(ValueError):
        GateConfig(max_running=4, max_running_beside=0).validate()


def test_beside_limits_follow_the_device() -> None:
    """Held where the model runs on the host's cores; elsewhere the cap alone, unless set."""
    from batcher.batch.gate import CPU_RUNNING_BESIDE, CPU_STARTS_PER_S_BESIDE, beside_limits

    cfg = GateConfig(max_running=16)
    assert beside_limits(cfg, on_cpu=True) == (CPU_RUNNING_BESIDE, CPU_STARTS_PER_S_BESIDE)
    assert beside_limits(cfg, on_cpu=False) == (16, float("inf"))
    assert beside_limits(GateConfig(max_running=4, max_running_beside=8,
                                    starts_per_s_beside=5.0), on_cpu=False) == (4, 5.0)
