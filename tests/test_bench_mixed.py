"""The mixed benchmark (`batcher bench --batch-lines`, `python -m scripts.bench batch_mixed`)
against a fake replica with the batch API: every phase runs within its bounds, the batch goes
through /v1/files and /v1/batches and completes, and the report says so. (The measurement itself,
on the bundled model, is the scenario's BENCHMARKS.md row.)"""

from __future__ import annotations

import aiohttp
import pytest

from batcher.batch.jsonl import parse_input
from batcher.bench.client import ClientConfig
from batcher.bench.mixed import MixedConfig, batch_lines, report_rows, run_mixed
from tests.fleet.procs import replica, running, wait_http

pytestmark = pytest.mark.timeout(120)


def test_batch_lines_are_a_valid_batch_input() -> None:
    import orjson

    mc = MixedConfig(lines=5, line_prompt_tokens=50, line_max_tokens=16)
    data = b"".join(orjson.dumps(x) + b"\n" for x in batch_lines(mc, "m"))
    lines, problems = parse_input(data, "/v1/completions", 100)
    assert not problems and len(lines) == 5
    assert all(len(x.body["prompt"]) == 50 and x.body["max_tokens"] == 16 for x in lines)
    with pytest.raises(ValueError):
        MixedConfig(rate_share=0).validate()


@pytest.mark.slow
async def test_a_mixed_run_against_a_fake_replica(tmp_path) -> None:
    rep = replica("mixed", "--data-dir", str(tmp_path / "data"), decode_ms=1.0)
    with running(rep):
        wait_http(rep.url + "/ready", procs=(rep,))
        mc = MixedConfig(slo_ttft_s=2.0, lines=20, rate=4.0, alone_s=1.0, max_s=30.0,
                         contrast_s=1.0, live_users=2).validate()
        async with aiohttp.ClientSession() as session:
            rep_ = await run_mixed(session, ClientConfig(rep.url, "fake", request_timeout=30),
                                   mc)
    assert [p.name for p in rep_.phases] == [
        "interactive alone (before)", "interactive + batch (batch API)",
        "interactive + live priority:batch", "interactive alone (after)"]
    assert rep_.batch_status == "completed" and rep_.batch_done == 20
    assert rep_.server["batcher_batch_lines_done_total{outcome=\"ok\"}"] == 20
    rows, notes, ok = report_rows(rep_, mc)
    assert "through /v1/files + /v1/batches" in notes
    assert len(rows) == 4 and "20/20 lines" in rows[1][8]
    assert ok == (rep_.phases[1].p99() <= 2.0)
