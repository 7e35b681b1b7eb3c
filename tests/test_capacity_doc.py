"""docs/capacity.md shows `batcher plan --example source` as the command prints it: one column
per shape it prints (the "no queueing" one included), the same figures in each."""

from __future__ import annotations

import json
from pathlib import Path

from batcher.app.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "capacity.md"


def test_the_plan_table_has_the_commands_columns_and_figures(capsys) -> None:
    assert main(["plan", "--example", "source", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    text = DOC.read_text()
    head = next(line for line in text.splitlines() if line.startswith("| | chat @"))
    columns = [c.strip() for c in head.strip("|").split("|")][1:]
    assert columns == [p["shape"]["name"] for p in plans]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")][1:]
            for line in text.splitlines() if line.startswith("| ") and "|" in line[2:]}
    assert rows["replicas by slots"] == [f"{p['by_slots']:,}" for p in plans]
    assert rows["needed (binding)"] == [f"{p['needed']:,} ({p['binding']})" for p in plans]
    assert rows["N+1 per zone"] == [f"{p['n_plus_one_per_zone']:,}" for p in plans]
    assert rows["in flight (rate × W)"] == [f"{p['in_flight']:,.0f}" for p in plans]
    # The page speaks for itself: no pointers to texts the reader does not have.
    assert "the source" not in text and "issue item" not in text
