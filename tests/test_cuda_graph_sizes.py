from __future__ import annotations

from batcher.runtime.cuda_graphs import graph_sizes, pick_size


def test_ladder_covers_every_batch_up_to_max():
    sizes = graph_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    for n in range(1, 257):
        b = pick_size(n, sizes)
        assert b is not None and b >= n and b - n < 16


def test_odd_max_and_overflow():
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(1) == [1]
    assert pick_size(21, graph_sizes(20)) is None


def test_decode_graphs_take_steps_whose_every_row_samples():
    """A one-token prompt chunk short of the prompt's end is a one-token row that samples
    nothing: the graphs return a logits row per row, so such a step is not theirs."""
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.runtime.cuda_graphs import DecodeGraphs

    graphs = object.__new__(DecodeGraphs)  # the checks alone: no capture without a GPU
    graphs.sizes, graphs.block_size, graphs.max_blocks = graph_sizes(8), 16, 4
    sp = SamplingParams(temperature=0.0)
    decodes = [ScheduledSeq("a", [1], 20, [0, 1], True, sp),
               ScheduledSeq("b", [2], 3, [2], True, sp)]
    assert graphs.can_run(SchedulerOutput(decodes))
    partial = ScheduledSeq("c", [3], 5, [3], False, sp)
    assert not graphs.can_run(SchedulerOutput([*decodes, partial]))
    assert not graphs.can_run(SchedulerOutput([ScheduledSeq("d", [1], 64, [0] * 5, True, sp)]))
