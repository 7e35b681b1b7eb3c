"""A batch survives `kill -9` of its server: after a restart on the same data directory it
resumes, lines answered before the crash are not run again, lines in flight at the crash run
again, and every line is answered exactly once in the output file."""

from __future__ import annotations

import io
import os
import signal
import sqlite3
import time
from pathlib import Path

import openai
import orjson
import pytest
from openai import OpenAI

from tests.server_process import Server, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LINES = 48
# The fake model: 20 ms a decode step, so a 40-token line takes about a second and the batch
# (16 lines at a time) several seconds: long enough to be killed in the middle.
FLAGS = ("--model", "fake", "--fake-decode-step-ms", "20", "--batch-max-running", "16")


def client_for(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


def metric(server: Server, name: str) -> float:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.url + "/metrics", timeout=10) as resp:
        for ln in resp.read().decode().splitlines():
            if ln.startswith(name + " "):
                return float(ln.split()[1])
    return 0.0


def test_kill_9_mid_batch_then_resume_answers_each_line_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    items = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"request {i}", "max_tokens": 40,
                       "ignore_eos": True}} for i in range(LINES)]
    with serve(*FLAGS, "--data-dir", str(data)) as first, client_for(first) as c:
        f = c.files.create(file=("in.jsonl", io.BytesIO(
            b"".join(orjson.dumps(x) + b"\n" for x in items))), purpose="batch")
        batch_id = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                    completion_window="24h").id
        deadline = time.monotonic() + 60
        while (done := c.batches.retrieve(batch_id).request_counts.completed) < 8:
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.05)
        assert done < LINES - 16, "the batch finished before it could be killed"
        # Kill while lines are in the engine (between two lines none may be, for a moment).
        while metric(first, "batcher_batch_lines_running") == 0:
            assert time.monotonic() < deadline, "no line was running to be cut"
            time.sleep(0.01)
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)

    # What the database held at the crash: answered lines, and pending ones (some of which were
    # running in the engine when it died).
    db = sqlite3.connect(data / "batches.sqlite3")
    (answered,) = db.execute("SELECT completed FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
    (pending,) = db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND "
                            "state = 'pending'", (batch_id,)).fetchone()
    db.close()
    assert answered >= done and answered + pending == LINES

    # The same lines after the restart, on a device ten times as fast: they run again whole.
    with serve(*FLAGS, "--fake-decode-step-ms", "2", "--data-dir", str(data)) as second, \
            client_for(second) as c:
        deadline = time.monotonic() + 90
        while (b := c.batches.retrieve(batch_id)).status != "completed":
            assert b.status in ("in_progress", "finalizing"), b.status
            assert time.monotonic() < deadline, f"not resumed: {b.request_counts}"
            time.sleep(0.1)
        # The restarted server ran exactly the lines that were not answered before the crash.
        ran_after = metric(second, 'batcher_batch_lines_done_total{outcome="ok"}')
        assert ran_after == LINES - answered
        assert b.request_counts.completed == LINES and b.request_counts.failed == 0
        assert b.error_file_id is None
        out = [orjson.loads(x) for x in c.files.content(b.output_file_id).content.splitlines()]
    ids = [x["custom_id"] for x in out]
    assert sorted(ids) == sorted(f"r{i}" for i in range(LINES)) and len(set(ids)) == LINES
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 40 for x in out)


def test_sigterm_mid_batch_exits_promptly_and_the_batch_resumes(tmp_path: Path) -> None:
    """A graceful stop does not wait for batch lines (only live requests hold a drain): the
    running lines end unanswered and run again after the restart."""
    data = tmp_path / "data"
    items = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"request {i}", "max_tokens": 600,
                       "ignore_eos": True}} for i in range(4)]
    with serve(*FLAGS, "--data-dir", str(data), shutdown_timeout=30) as first, \
            client_for(first) as c:
        f = c.files.create(file=("in.jsonl", io.BytesIO(
            b"".join(orjson.dumps(x) + b"\n" for x in items))), purpose="batch")
        batch_id = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                    completion_window="24h").id
        deadline = time.monotonic() + 30
        while metric(first, "batcher_batch_lines_running") == 0:
            assert time.monotonic() < deadline, "no line started"
            time.sleep(0.05)
        stopping = time.monotonic()
        assert first.stop() == 0
        # 600-token lines take about 12 s each: the stop did not wait for them (the bound is
        # loose for a loaded machine).
        assert time.monotonic() - stopping < 8.0
    # The same lines after the restart, on a device ten times as fast: they run again whole.
    with serve(*FLAGS, "--fake-decode-step-ms", "2", "--data-dir", str(data)) as second, \
            client_for(second) as c:
        deadline = time.monotonic() + 90
        while (b := c.batches.retrieve(batch_id)).status != "completed":
            assert b.status in ("in_progress", "finalizing"), b.status
            assert time.monotonic() < deadline, f"not resumed: {b.request_counts}"
            time.sleep(0.1)
        out = [orjson.loads(x) for x in c.files.content(b.output_file_id).content.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"s{i}" for i in range(4))
