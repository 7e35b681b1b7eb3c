"""Intra-op threads per step size, chosen by measured time per row."""

from __future__ import annotations

import pytest

from batcher.runtime.thread_tuner import TUNED_BELOW_ROWS, ThreadTuner, candidates, group_of


def test_candidates_are_all_one_fewer_and_half() -> None:
    assert candidates(1) == (1,)
    assert candidates(2) == (2, 1)
    assert candidates(8) == (8, 7, 4)


def test_groups_are_powers_of_two_of_rows() -> None:
    assert [group_of(r) for r in (0, 1, 2, 3, 4, 7, 8)] == [0, 0, 1, 1, 2, 2, 3]
    assert group_of(10**6) == group_of(1024)


def run(tuner: ThreadTuner, rows: int, cost: dict[int, float], steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        n = tuner.threads(rows)
        used.append(n)
        tuner.record(rows, n, cost[n] * rows)
    return used


def test_small_steps_keep_the_faster_count_and_big_steps_run_on_every_thread() -> None:
    choices = []
    tuner = ThreadTuner(2, samples=4, on_choice=lambda g, n, m: choices.append((g, n)))
    small = run(tuner, 1, {2: 0.036, 1: 0.028}, 20)
    eight = run(tuner, 8, {2: 0.003, 1: 0.005}, 20)
    big = run(tuner, TUNED_BELOW_ROWS, {2: 0.003, 1: 0.001}, 20)
    assert small[:8] == [2, 1] * 4  # interleaved while measuring
    assert set(small[8:]) == {1} and set(eight[8:]) == {2}
    assert set(big) == {2}  # never tried on fewer: a prefill's rate is what TTFT is predicted from
    assert tuner.chosen() == {1: 1, 8: 2}
    assert choices == [(0, 1), (3, 2)]


def test_a_group_measures_again_after_recheck_every_steps() -> None:
    tuner = ThreadTuner(2, samples=2, recheck_every=5)
    run(tuner, 1, {2: 0.030, 1: 0.020}, 4)
    assert tuner.chosen() == {1: 1}
    used = run(tuner, 1, {2: 0.010, 1: 0.020}, 5 + 4 + 3)  # the machine changed
    assert used[:5] == [1] * 5 and used[5:9] == [2, 1, 2, 1]
    assert tuner.chosen() == {1: 2} and set(used[9:]) == {2}


def test_ties_go_to_more_threads_and_one_thread_is_never_tuned() -> None:
    tuner = ThreadTuner(2, samples=2)
    run(tuner, 3, {2: 0.01, 1: 0.01}, 4)
    assert tuner.chosen() == {2: 2}
    one = ThreadTuner(1, samples=2)
    assert set(run(one, 1, {1: 0.01}, 6)) == {1}


def test_a_step_that_reads_a_prompt_runs_on_every_thread_and_is_not_a_sample() -> None:
    tuner = ThreadTuner(2, samples=2)
    run(tuner, 8, {2: 0.005, 1: 0.003}, 4)
    assert tuner.chosen() == {8: 1}  # decode rows alone: one thread
    assert tuner.threads(12, reads_prompt=True) == 2  # 8 of them with a 4-token chunk: all
    tuner.record(12, 2, 0.5, reads_prompt=True)
    tuner.record(12, 1, 0.5, reads_prompt=True)
    assert tuner.chosen() == {8: 1} and tuner._groups[3].since == 0


def test_a_sample_taken_with_another_count_than_the_turn_is_ignored() -> None:
    tuner = ThreadTuner(2, samples=1)
    tuner.record(1, 1, 0.5)  # the group's turn is 2 threads: not a sample
    assert tuner.chosen() == {}
    assert tuner.threads(1) == 2


@pytest.fixture
def runner_on_two_threads(tiny_fp32):
    """A CPU runner loaded under two intra-op threads, and one decode step for it; torch's count
    is put back after the test."""
    import torch

    from batcher.runtime.model_runner import ModelRunner
    from batcher.sim.calibrate import Point, build_step

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield (ModelRunner(tiny_fp32, num_blocks=64, block_size=16),
               build_step(Point(n_dec=1, ctx=40), 64, 16))
    finally:
        torch.set_num_threads(before)


def test_the_cpu_runner_tunes_its_threads_and_answers_the_same(runner_on_two_threads) -> None:
    runner, step = runner_on_two_threads
    first = runner.execute(step).token_ids
    assert runner.tuner is not None
    used = set()
    record = runner.tuner.record
    runner.tuner.record = lambda rows, n, *rest: (  # type: ignore[method-assign]
        used.add(n), record(rows, n, *rest))
    for _ in range(40):
        assert runner.execute(step).token_ids == first
    assert used == {1, 2} and set(runner.tuner.chosen()) == {1}


def test_a_step_on_fewer_threads_leaves_the_process_default_as_it_was(
        runner_on_two_threads) -> None:
    """torch's count is also what threads started later begin with: a tuned step puts it back."""
    import threading

    import torch

    runner, step = runner_on_two_threads
    worker = threading.Thread(target=lambda: [runner.execute(step) for _ in range(20)])
    worker.start()
    worker.join()
    assert runner.tuner is not None and set(runner.tuner.chosen()) == {1}
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [2] and runner.max_threads == 2


def test_the_cpu_runner_reads_a_prompt_chunk_on_every_thread(runner_on_two_threads) -> None:
    import torch

    from batcher.sim.calibrate import Point, build_step

    runner, decode = runner_on_two_threads
    tuner = ThreadTuner(2, samples=2)
    run(tuner, 1, {2: 0.01, 1: 0.001}, 4)  # one decode row, and four: one thread chosen
    run(tuner, 4, {2: 0.01, 1: 0.001}, 4)
    runner.tuner = tuner
    mixed = build_step(Point(n_dec=1, ctx=40, chunks=1, chunk=3, start=0), 64, 16)
    assert mixed.num_batched_tokens == 4
    used: list[int] = []
    launch = runner._launch
    runner._launch = lambda sched, before: (  # type: ignore[method-assign]
        used.append(torch.get_num_threads()), launch(sched, before))[1]
    runner.execute(mixed)
    runner.execute(decode)
    assert used == [2, 1] and torch.get_num_threads() == 2


def test_a_step_verifying_drafts_is_tuned_as_decode_rows_are(runner_on_two_threads) -> None:
    import torch

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.sim.calibrate import GREEDY

    runner, _ = runner_on_two_threads
    tuner = ThreadTuner(2, samples=2)
    run(tuner, 3, {2: 0.01, 1: 0.001}, 4)  # steps of 2-3 rows: one thread chosen
    runner.tuner = tuner
    # One real new token and two drafts: three rows, no prompt read.
    verify = SchedulerOutput([ScheduledSeq("v", [5, 6, 7], 20, [0, 1], True, GREEDY,
                                           output_index=1, draft_token_ids=(6, 7))])
    used: list[int] = []
    launch = runner._launch
    runner._launch = lambda sched, before: (  # type: ignore[method-assign]
        used.append(torch.get_num_threads()), launch(sched, before))[1]
    runner.execute(verify)
    assert used == [1]
