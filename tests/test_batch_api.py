"""The batch API through the official `openai` client against a real `batcher serve` process
(tiny model): files and batches in OpenAI's shapes, tenant scoping, limits, cancel, expiry, and
tenant token budgets charged for batch lines as for live requests."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from openai import OpenAI

from tests.server_process import Server, server_fixture, write_tenants

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
KEY, OTHER_KEY, POOR_KEY = "batch-key-0123", "other-key-4567", "poor-key-8901"
LIVE_KEY = "live-only-key-2345"
MAX_FILE_BYTES = 64 * 1024


def setup(tmp: pytest.TempPathFactory) -> list[str]:
    root = tmp.mktemp("batch")
    tenants = write_tenants(root / "tenants.toml", {
        "acme": {"key": KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 64},
        "other": {"key": OTHER_KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 64},
        # One line of about 25 tokens fits; the bucket then refills at 1 token a second.
        "poor": {"key": POOR_KEY, "tokens_per_minute": 60, "burst": 40, "max_concurrent": 4},
        "live": {"key": LIVE_KEY, "tokens_per_minute": 10_000, "max_concurrent": 4,
                 "priorities": ["interactive"]},
    })
    return ["--tenants", str(tenants), "--data-dir", str(root / "data"),
            "--batch-max-file-bytes", str(MAX_FILE_BYTES)]


server = server_fixture(setup=setup)


def client_for(server: Server, key: str) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[OpenAI]:
    with client_for(server, KEY) as c:
        yield c


@pytest.fixture(scope="module")
def other(server: Server) -> Iterator[OpenAI]:
    with client_for(server, OTHER_KEY) as c:
        yield c


def line(cid: str, url: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    if url == "/v1/chat/completions":
        base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": cid}]}
    else:
        base = {"model": MODEL, "prompt": f"line {cid}"}
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {**base, "max_tokens": 4, "ignore_eos": True, **body}}


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(i) + b"\n" for i in items)


def upload(client: OpenAI, items: list[dict[str, Any]], name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(items))), purpose="batch")


def wait_done(client: OpenAI, batch_id: str, within: float = 60.0):
    deadline = time.monotonic() + within
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.1)


def read_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


def test_files_create_list_retrieve_content_delete(client: OpenAI, other: OpenAI) -> None:
    items = [line("a"), line("b")]
    f = upload(client, items, "mine.jsonl")
    assert f.object == "file" and f.purpose == "batch" and f.filename == "mine.jsonl"
    assert f.bytes == len(jsonl(items)) and f.id.startswith("file-")
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.content(f.id).content == jsonl(items)
    # Another tenant cannot see it, read it or delete it.
    assert f.id not in [x.id for x in other.files.list()]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_file_pages(client: OpenAI) -> None:
    ids = [upload(client, [line("p")]).id for _ in range(3)]
    first = client.files.list(limit=2, order="asc", after=ids[0])
    assert [x.id for x in first.data] == ids[1:]


@pytest.mark.parametrize("data, purpose, status, code", [
    (b"not json\n", "batch", 400, "invalid_json"),
    (jsonl([line("a"), line("a")]), "batch", 400, "duplicate_custom_id"),
    (jsonl([line("a", url="/v1/other")]), "batch", 400, "invalid_url"),
    (jsonl([line("a")]), "fine-tune", 400, None),
    (b"x" * (MAX_FILE_BYTES + 1), "batch", 413, "file_too_large"),
])
def test_bad_uploads_are_refused(client: OpenAI, data: bytes, purpose: str, status: int,
                                 code: str | None) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("x.jsonl", io.BytesIO(data)), purpose=purpose)  # type: ignore[arg-type]
    assert err.value.status_code == status
    body = err.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body)
    if code is not None:
        assert body["code"] == code


def test_batch_runs_to_completion(client: OpenAI, other: OpenAI) -> None:
    items = [line(f"c{i}", "/v1/chat/completions") for i in range(6)]
    items.append(line("bad", "/v1/chat/completions", model="nope"))
    f = upload(client, items)
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"job": "t1"})
    assert b.object == "batch" and b.status == "in_progress" and b.metadata == {"job": "t1"}
    assert b.request_counts is not None and b.request_counts.total == 7
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(b.id)
    assert b.id not in [x.id for x in other.batches.list()]
    done = wait_done(client, b.id)
    assert done.status == "completed" and done.completed_at and done.finalizing_at
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(6)]
    for x in out:
        resp = x["response"]
        assert resp["status_code"] == 200 and x["error"] is None
        assert resp["body"]["object"] == "chat.completion"
        assert resp["body"]["usage"]["completion_tokens"] == 4
        assert resp["body"]["choices"][0]["finish_reason"] == "length"
    [bad] = err
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["code"] == "model_not_found"
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_bad_batch_requests(client: OpenAI) -> None:
    f = upload(client, [line("a")])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/other",  # type: ignore[arg-type]
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="forever")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/completions",
                              completion_window="24h")
    # A file whose lines name another endpoint: the batch is created failed, with its errors.
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert b.status == "failed" and b.errors is not None and b.errors.data
    assert b.errors.data[0].code == "mismatched_url" and b.errors.data[0].line == 1
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)


def test_a_key_without_batch_priority_cannot_create_batches(server: Server) -> None:
    with client_for(server, LIVE_KEY) as live:
        f = upload(live, [line("a")])
        with pytest.raises(openai.PermissionDeniedError) as err:
            live.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                completion_window="24h")
        assert err.value.body["code"] == "priority_not_allowed"  # type: ignore[index]


def test_cancel_answers_every_line_once(client: OpenAI) -> None:
    items = [line(f"k{i}", max_tokens=64) for i in range(40)]
    b = client.batches.create(input_file_id=upload(client, items).id,
                              endpoint="/v1/completions", completion_window="24h")
    time.sleep(0.5)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    done = wait_done(client, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + err) == sorted(f"k{i}" for i in range(40))
    assert err and {x["error"]["code"] for x in err} == {"batch_cancelled"}


def test_completion_window_expiry_keeps_finished_lines(client: OpenAI) -> None:
    # A few short lines finish early; 60 long ones cannot all finish within the window.
    items = [line(f"e{i}", max_tokens=2 if i < 3 else 200) for i in range(60)]
    b = client.batches.create(input_file_id=upload(client, items).id,
                              endpoint="/v1/completions", completion_window="3s")  # type: ignore[arg-type]
    done = wait_done(client, b.id)
    assert done.status == "expired" and done.expired_at
    out, err = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert out, "some lines finish within the window"
    assert len(out) + len(err) == 60 and len(out) < 60
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert {x["error"]["code"] for x in err} == {"batch_expired"}


def test_batch_lines_charge_the_tenant_budget(server: Server) -> None:
    with client_for(server, POOR_KEY) as poor:
        f = upload(poor, [line("only", max_tokens=20)])
        b = poor.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                completion_window="24h")
        done = wait_done(poor, b.id)
        assert done.status == "completed" and done.request_counts.completed == 1
        # The line took about 25 of the bucket's 40 tokens: a live request of the same size
        # must now wait for the refill.
        with pytest.raises(openai.RateLimitError):
            poor.completions.create(model=MODEL, prompt="line only", max_tokens=20,
                                    extra_body={"ignore_eos": True})


def test_metrics_count_batch_lines(server: Server, client: OpenAI) -> None:
    b = client.batches.create(input_file_id=upload(client, [line("m1"), line("m2")]).id,
                              endpoint="/v1/completions", completion_window="24h")
    wait_done(client, b.id)
    text = _metrics(server)
    assert 'batcher_batch_lines_done_total{outcome="ok"}' in text
    assert "batcher_batch_lines_queued 0.0" in text
    assert "batcher_batch_lines_running 0.0" in text
    tokens = [ln for ln in text.splitlines()
              if ln.startswith("batcher_batch_spare_capacity_tokens_total ")]
    assert tokens and float(tokens[0].split()[1]) > 0


def _metrics(server: Server) -> str:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()
