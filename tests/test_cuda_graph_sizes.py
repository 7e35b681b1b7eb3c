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


def test_a_replay_copies_each_rows_inputs_and_table():
    """The host side of a replay (the graph itself stubbed, on the CPU): each row's token,
    position, slot, length and block ids land in the captured buffers; padding rows write the
    scratch slot and attend to one token, whatever an earlier, larger step left there."""
    import torch

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.runtime.cuda_graphs import DecodeGraphs

    replayed: list[int] = []

    class Stub(DecodeGraphs):
        def _capture(self, device: torch.device) -> None:
            for b in self.sizes:
                self.graphs[b] = type("G", (), {"replay": lambda s, b=b: replayed.append(b)})()
                self.outputs[b] = torch.zeros(b, 3)

    graphs = Stub(None, None, 16, 9, 4, graph_sizes(4), torch.device("cpu"))
    sp = SamplingParams(temperature=0.0)
    three = [ScheduledSeq("a", [11], 40, [5, 6, 7], True, sp),
             ScheduledSeq("b", [12], 3, [2], True, sp),
             ScheduledSeq("c", [13], 16, [0, 8], True, sp)]
    graphs.run(SchedulerOutput(three))
    assert graphs.ids[:3].tolist() == [11, 12, 13]
    assert graphs.positions[:3].tolist() == [40, 3, 16]
    assert graphs.slots[:4].tolist() == [7 * 16 + 8, 2 * 16 + 3, 8 * 16, 9 * 16]
    assert graphs.lens[:4].tolist() == [41, 4, 17, 1]
    assert graphs.tables[0, :3].tolist() == [5, 6, 7] and graphs.tables[1, 0] == 2
    assert graphs.tables[2, :2].tolist() == [0, 8]
    out = graphs.run(SchedulerOutput([ScheduledSeq("b", [14], 4, [2], True, sp)]))
    assert out.shape[0] == 1 and replayed == [4, 1]
    assert graphs.ids[0] == 14 and graphs.slots[0] == 2 * 16 + 4 and graphs.lens[0] == 5
