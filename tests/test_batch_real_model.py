"""The batch API's basic flow on the bundled models at default settings, with the official client:
upload, create, poll, download; live requests are answered while the batch runs; embeddings
lines through the embedding model."""

from __future__ import annotations

import io
import time
from pathlib import Path

import openai
import orjson
import pytest
from openai import OpenAI

from tests.server_process import serve

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

MODEL = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 3 + 4?",
             "Say hello in Spanish.", "What do bees make?", "Name a planet."]


def test_batch_on_the_bundled_model(tmp_path: Path) -> None:
    items = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 12, "temperature": 0,
                       "messages": [{"role": "user", "content": q}]}}
             for i, q in enumerate(QUESTIONS)]
    embed = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "all-minilm-l6-v2", "input": [q, q.upper()]}}
             for i, q in enumerate(QUESTIONS[:3])]
    with serve("--model", MODEL, "--log-level", "warning", "--embedding-model", "minilm",
               "--data-dir", str(tmp_path / "data")) as server, OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60,
            http_client=openai.DefaultHttpxClient(trust_env=False)) as client:
        f = client.files.create(file=("questions.jsonl", io.BytesIO(
            b"".join(orjson.dumps(x) + b"\n" for x in items))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        # Interactive traffic is served while the batch runs.
        live = client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is 2 + 2?"}])
        assert live.choices[0].message.content
        deadline = time.monotonic() + 150
        while (b := client.batches.retrieve(batch.id)).status != "completed":
            assert b.status in ("in_progress", "finalizing"), b
            assert time.monotonic() < deadline, f"batch not done: {b.request_counts}"
            time.sleep(0.2)
        assert b.request_counts is not None and b.request_counts.completed == len(QUESTIONS)
        assert b.output_file_id is not None and b.error_file_id is None
        out = [orjson.loads(x) for x in
               client.files.content(b.output_file_id).content.splitlines()]
        # Embeddings lines go through the embedding batcher.
        ef = client.files.create(file=("embed.jsonl", io.BytesIO(
            b"".join(orjson.dumps(x) + b"\n" for x in embed))), purpose="batch")
        eb = client.batches.create(input_file_id=ef.id, endpoint="/v1/embeddings",
                                   completion_window="24h")
        while (eb := client.batches.retrieve(eb.id)).status != "completed":
            assert eb.status in ("in_progress", "finalizing"), eb
            assert time.monotonic() < deadline, f"batch not done: {eb.request_counts}"
            time.sleep(0.2)
        vectors = [orjson.loads(x)["response"]["body"]["data"] for x in
                   client.files.content(eb.output_file_id).content.splitlines()]
    assert [len(v) for v in vectors] == [2, 2, 2]
    assert all(len(item["embedding"]) == 384 for v in vectors for item in v)
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(len(QUESTIONS))]
    answers = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
               for x in out}
    assert "paris" in answers["q0"].lower(), answers
    assert all(a.strip() for a in answers.values()), answers
