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
