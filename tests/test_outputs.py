"""The step's row order is made in one place: `SchedulerOutput` puts decode rows first."""

from __future__ import annotations

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.sampling import SamplingParams


def seq(rid: str, n: int, start: int) -> ScheduledSeq:
    return ScheduledSeq(rid, list(range(n)), start, [0, 1, 2, 3], True, SamplingParams())


def test_decode_rows_first_stable_and_counted() -> None:
    out = SchedulerOutput([seq("p1", 5, 0), seq("d1", 1, 9), seq("p2", 3, 4), seq("d2", 1, 0),
                           seq("d3", 1, 30)])
    assert [s.request_id for s in out.seqs] == ["d1", "d2", "d3", "p1", "p2"]
    assert out.num_decodes == 3
    # A one-token row at position 0 (a one-token prompt) is the same computation as a decode.
    assert seq("x", 1, 0).is_decode and not seq("y", 2, 7).is_decode


def test_all_one_kind_and_empty() -> None:
    assert SchedulerOutput([seq("a", 4, 0), seq("b", 2, 0)]).num_decodes == 0
    assert SchedulerOutput([seq("a", 1, 3), seq("b", 1, 8)]).num_decodes == 2
    empty = SchedulerOutput()
    assert empty.is_empty and empty.num_decodes == 0
