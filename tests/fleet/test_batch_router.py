"""The batch API through a router, with the official `openai` client: two fake replicas (each
with its own data directory) behind `batcher router`, files and batches created, read, listed,
paged and cancelled through it; another tenant's ids are 404s, forged ids reach no replica, and
a replica that is down is a 503 for what it holds (`test_batch_ids.py` has the pure parts: ids,
merging, the choice of replica)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from openai import OpenAI

from batcher.fleet.router import batch_ids
from tests.fleet.procs import Proc, replica, router, running, wait_http
from tests.server_process import write_tenants

pytestmark = pytest.mark.timeout(120)

KEY, OTHER_KEY = "router-batch-key-1", "router-batch-key-2"


def client(url: str, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


def jsonl(n: int, tag: str) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "fake", "prompt": f"{tag} {i}", "max_tokens": 3}}) + b"\n"
        for i in range(n))


def owner(object_id: str) -> str:
    decoded = batch_ids.decode(object_id)
    assert decoded is not None, object_id
    return decoded[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("batch-router")
    tenants = write_tenants(root / "tenants.toml", {
        "acme": {"key": KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 64},
        "other": {"key": OTHER_KEY, "tokens_per_minute": 10_000_000, "max_concurrent": 64}})
    reps = [replica(f"r{i}", "--tenants", str(tenants), "--data-dir", str(root / f"d{i}"),
                    decode_ms=1.0, num_blocks=256) for i in range(2)]
    ids = [f"127.0.0.1:{r.port}" for r in reps]  # the router's id for a `--replica URL`
    rt = router(replicas=tuple(reps))
    with running(*reps, rt):
        for p in (*reps, rt):
            wait_http(p.url + "/ready", procs=(p,))
        yield {"replicas": reps, "ids": ids, "router": rt}


def test_files_and_batches_through_the_router(fleet) -> None:
    with client(fleet["router"].url) as c:
        f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(3, "a"))), purpose="batch")
        assert owner(f.id) in fleet["ids"] and f.id.startswith("file-")
        assert c.files.retrieve(f.id).id == f.id
        assert c.files.content(f.id).read() == jsonl(3, "a")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")
        assert owner(b.id) == owner(f.id) and b.input_file_id == f.id
        deadline = time.monotonic() + 30
        while b.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            b = c.batches.retrieve(b.id)
        assert b.status == "completed", b
        assert b.request_counts.completed == 3
        assert b.output_file_id is not None and owner(b.output_file_id) == owner(f.id)
        out = [orjson.loads(x) for x in c.files.content(b.output_file_id).read().splitlines()]
        assert sorted(x["custom_id"] for x in out) == ["a-0", "a-1", "a-2"]
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert b.id in [x.id for x in c.batches.list(limit=100)]
        with pytest.raises(openai.ConflictError):  # the replica's answer, passed on
            c.batches.cancel(b.id)
        assert c.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(f.id)


def test_other_tenants_and_forged_ids_are_404(fleet) -> None:
    with client(fleet["router"].url) as c, client(fleet["router"].url, OTHER_KEY) as o:
        f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(1, "s"))), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")
        for call in (lambda: o.files.retrieve(f.id), lambda: o.files.content(f.id),
                     lambda: o.files.delete(f.id), lambda: o.batches.retrieve(b.id),
                     lambda: o.batches.cancel(b.id),
                     lambda: o.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert f.id not in [x.id for x in o.files.list()]
        inner = batch_ids.decode(f.id)[0]
        forged = [inner, "file-x.", f"{inner}.!!", batch_ids.encode(inner, "evil.example:80"),
                  batch_ids.encode(inner, "http://127.0.0.1:1")]
        for fid in forged:
            with pytest.raises(openai.NotFoundError) as err:
                c.files.retrieve(fid)
            assert err.value.body["code"] == "file_not_found"
        with pytest.raises(openai.BadRequestError):
            c.files.list(after=forged[0])


def test_lists_merge_both_replicas_with_pagination(fleet) -> None:
    # Files made on each replica directly (the router lists whatever its replicas hold).
    made = []
    for i in range(6):
        rep: Proc = fleet["replicas"][i % 2]
        with client(rep.url) as direct:
            f = direct.files.create(file=(f"p{i}.jsonl", io.BytesIO(jsonl(1, f"p{i}"))),
                                    purpose="batch")
            made.append(batch_ids.encode(f.id, fleet["ids"][i % 2]))
    with client(fleet["router"].url) as c:
        # Both replicas must be ones the router trusts: on a loaded machine a late state poll
        # can leave one out for a moment, and the router then answers a list marked partial.
        deadline = time.monotonic() + 20
        while (c.files.list().model_extra or {}).get("partial") and time.monotonic() < deadline:
            time.sleep(0.2)
        pages = c.files.list(limit=2)
        assert len(pages.data) == 2 and pages.has_more
        seen = [x.id for x in c.files.list(limit=2)]  # the auto-paginator follows `after`
        assert len(seen) == len(set(seen)) and set(made) <= set(seen)
        created = [x.created_at for x in c.files.list(limit=3)]
        assert created == sorted(created, reverse=True)
        asc = [x.id for x in c.files.list(limit=4, order="asc")]
        assert asc == list(reversed(seen))
        with pytest.raises(openai.BadRequestError):
            c.files.list(limit=0)


def test_a_replica_that_is_down_is_a_503(fleet) -> None:
    """Last: it stops a replica. What it holds is a 503; a list answers with what the other
    holds and says it is partial."""
    with client(fleet["replicas"][1].url) as direct:
        made = direct.files.create(file=("in.jsonl", io.BytesIO(jsonl(1, "d"))),
                                   purpose="batch")
    f = batch_ids.encode(made.id, fleet["ids"][1])
    fleet["replicas"][1].stop()
    with client(fleet["router"].url) as c:
        page = c.files.list()
        assert page.model_extra and page.model_extra.get("partial") is True
        assert f not in [x.id for x in page.data]
        assert all(owner(x.id) == fleet["ids"][0] for x in page.data)
        for call in (lambda: c.files.retrieve(f),
                     lambda: c.batches.create(input_file_id=f, endpoint="/v1/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.APIStatusError) as err:
                call()
            assert err.value.status_code == 503, err.value
            assert err.value.body["code"] == "replica_unavailable"
            assert err.value.response.headers.get("Retry-After")
