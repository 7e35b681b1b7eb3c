"""`write_rows`: a step's block ids scattered into a table, a few rows by a loop and more in one
vectorised pass, as a row-by-row loop of torch ops would write them."""

from __future__ import annotations

import random

import pytest
import torch

from batcher.runtime.step_rows import FEW_ROWS, write_rows


@pytest.mark.parametrize("count", [FEW_ROWS, FEW_ROWS + 5])
def test_rows_get_their_ids_and_nothing_else_changes(count: int) -> None:
    rng = random.Random(count)
    table = torch.full((16, 12), -1, dtype=torch.int32)
    want = table.clone()
    rows = rng.sample(range(16), count)
    blocks = [[rng.randrange(1000) for _ in range(rng.choice([0, 1, 5, 12]))] for _ in rows]
    for r, b in zip(rows, blocks):
        want[r, :len(b)] = torch.tensor(b, dtype=torch.int32)
    write_rows(table, rows, blocks)
    assert torch.equal(table, want)
    write_rows(table, [], [])
    assert torch.equal(table, want)


def test_a_row_wider_than_the_table_is_refused() -> None:
    table = torch.zeros(8, 3, dtype=torch.int32)
    with pytest.raises(ValueError):
        write_rows(table, range(FEW_ROWS + 1), [[1, 2, 3, 4]] * (FEW_ROWS + 1))
