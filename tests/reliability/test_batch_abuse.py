"""Hostile batch input against a real `batcher serve` (tiny model, two tenants), one test per
finding of an adversarial pass over the batch tier:

- a line that can never run (a `max_tokens` of a trillion) fails alone, at once, and another
  tenant's batch completes promptly; tenants take turns rather than the oldest batch going first;
- a line of megabytes of empty lists is refused at upload, and a file of lines just under the
  line limit fails line by line, while `/health` keeps answering within 0.5 s and the server's
  memory grows by a small multiple of the upload at most;
- per-tenant file quotas (count and bytes) answer a 400 in OpenAI's shape; files expire and are
  deleted.

Servers listen on 127.0.0.1 and are stopped by the module; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai import OpenAI

from tests.reliability.conftest import rss_bytes
from tests.server_process import Server, assert_error_shape, serve, write_tenants

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
ACME, OTHER = "acme-key-0123", "other-key-4567"
HEALTH_BOUND_S = 0.5


def tenants(root: Path) -> Path:
    budget = {"tokens_per_minute": 10_000_000, "max_concurrent": 64}
    return write_tenants(root / "tenants.toml", {"acme": {"key": ACME, **budget},
                                                 "other": {"key": OTHER, **budget}})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("batch-abuse")
    # Four lines at once: turns between tenants are visible in a few seconds.
    with serve("--tenants", str(tenants(root)), "--data-dir", str(root / "data"),
               "--batch-max-running", "4") as s:
        yield s


def client_for(server: Server, key: str) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60,
                  http_client=openai.DefaultHttpxClient(trust_env=False))


def line(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"line {cid}", "max_tokens": 4,
                     "ignore_eos": True, **body}}


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(i) + b"\n" for i in items)


def submit(client: OpenAI, items: list[dict[str, Any]]) -> str:
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(items))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h").id


def wait_done(client: OpenAI, batch_id: str, within: float):
    deadline = time.monotonic() + within
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, (
            f"batch {batch_id} still {b.status} after {within:g}s: {b.request_counts}")
        time.sleep(0.05)


def read_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


# H1 ------------------------------------------------------------------------------------------
def test_a_line_that_never_fits_fails_alone_and_blocks_no_tenant(server: Server) -> None:
    with client_for(server, ACME) as acme, client_for(server, OTHER) as other:
        hostile = submit(acme, [line("e", max_tokens=999_999_999_999), line("fine")])
        start = time.monotonic()
        theirs = submit(other, [line(f"o{i}") for i in range(3)])
        done = wait_done(other, theirs, within=20.0)
        took = time.monotonic() - start
        print(f"\nanother tenant's 3 lines done in {took:.2f}s beside the never-fitting line")
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.completed == 3, done.request_counts
        # The hostile batch ends too: its bad line answered alone, its good one run.
        mine = wait_done(acme, hostile, within=20.0)
        assert mine.status == "completed" and mine.request_counts is not None
        assert (mine.request_counts.completed, mine.request_counts.failed) == (1, 1)
        [bad] = read_lines(acme, mine.error_file_id)
        assert bad["custom_id"] == "e" and bad["response"]["status_code"] == 400
        err = assert_error_shape(bad["response"]["body"])
        assert err["param"] == "max_tokens", err
        assert [x["custom_id"] for x in read_lines(acme, mine.output_file_id)] == ["fine"]
    assert took < 20.0


def test_tenants_take_turns(server: Server) -> None:
    """A tenant's long batch does not make another's short one wait for all of it to start."""
    with client_for(server, ACME) as acme, client_for(server, OTHER) as other:
        big = submit(acme, [line(f"b{i}", max_tokens=48) for i in range(40)])
        small = submit(other, [line(f"s{i}", max_tokens=48) for i in range(3)])
        done = wait_done(other, small, within=60.0)
        ahead = acme.batches.retrieve(big).request_counts
        assert done.status == "completed" and ahead is not None
        print(f"\n3-line batch done with the 40-line one at {ahead.completed}/40")
        # Oldest-first would have started all 40 of acme's lines before these 3 (four at a
        # time): at least 36 of them done by now. Taking turns, at most a few rounds of four.
        assert ahead.completed + ahead.failed <= 24, ahead
        assert wait_done(acme, big, within=90.0).status == "completed"


# H2 ------------------------------------------------------------------------------------------
async def _health_while(url: str, work: asyncio.Task[Any]) -> list[float]:
    """Latencies of GET /health every 50 ms until `work` ends."""
    seen: list[float] = []
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as s:
        while not work.done():
            t0 = time.monotonic()
            async with s.get(url + "/health") as resp:
                assert resp.status == 200
                await resp.read()
            seen.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)
    return seen


async def _upload(url: str, key: str, data: bytes) -> tuple[int, Any]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="hostile.jsonl", content_type="application/jsonl")
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as s:
        async with s.post(url + "/v1/files", data=form,
                          headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


async def _create(url: str, key: str, file_id: str) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as s:
        async with s.post(url + "/v1/batches", json={
                "input_file_id": file_id, "endpoint": "/v1/completions",
                "completion_window": "24h"}, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


def empty_lists_line(cid: str, size: int) -> bytes:
    """A completion line whose prompt is `[[],[],...]`, about `size` bytes long."""
    head = orjson.dumps({"custom_id": cid, "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": None}})
    before, after = head.split(b"null")
    count = max(1, (size - len(head)) // 3)
    return before + b"[" + b"[]," * (count - 1) + b"[]]" + after


async def test_a_huge_line_is_refused_and_the_loop_keeps_answering(server: Server) -> None:
    data = empty_lists_line("h", 15 * 2**20) + b"\n"  # 5 million empty lists
    rss0 = rss_bytes(server.proc.pid)
    upload = asyncio.create_task(_upload(server.url, ACME, data))
    health = await _health_while(server.url, upload)
    status, body = upload.result()
    grew = rss_bytes(server.proc.pid) - rss0
    code = body.get("error", body).get("code")
    print(f"\n15 MiB line: {status} {code}; /health max {max(health) * 1e3:.0f} ms over "
          f"{len(health)} polls; RSS +{grew / 2**20:.1f} MiB")
    assert status == 400, body
    assert assert_error_shape(body)["code"] == "line_too_large"
    assert health and max(health) < HEALTH_BOUND_S, f"/health took up to {max(health):.3f}s"
    assert grew < 2 * len(data), f"RSS grew {grew / 2**20:.0f} MiB for a 15 MiB upload"


async def test_lines_just_under_the_limit_fail_alone_without_stalls(server: Server) -> None:
    # Twelve lines of a third of a million empty lists each, and one ordinary line.
    data = b"".join(empty_lists_line(f"h{i}", 2**20 - 256) + b"\n" for i in range(12))
    data += jsonl([line("ok")])
    rss0 = rss_bytes(server.proc.pid)

    async def both() -> tuple[int, Any]:
        status, f = await _upload(server.url, ACME, data)
        assert status == 200, f
        return await _create(server.url, ACME, f["id"])

    work = asyncio.create_task(both())
    health = await _health_while(server.url, work)
    status, batch = work.result()
    assert status == 200, batch
    assert health and max(health) < HEALTH_BOUND_S, f"/health took up to {max(health):.3f}s"
    with client_for(server, ACME) as acme:
        done = wait_done(acme, batch["id"], within=30.0)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 12)
        errors = read_lines(acme, done.error_file_id)
        assert sorted(x["custom_id"] for x in errors) == sorted(f"h{i}" for i in range(12))
        assert {x["response"]["status_code"] for x in errors} == {400}
    grew = rss_bytes(server.proc.pid) - rss0
    print(f"\n12 lines of ~1 MiB: /health max {max(health) * 1e3:.0f} ms over {len(health)} "
          f"polls; RSS +{grew / 2**20:.1f} MiB for {len(data) / 2**20:.1f} MiB")
    assert grew < 4 * len(data), f"RSS grew {grew / 2**20:.0f} MiB for a 12 MiB upload"


# M3 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quota_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("batch-quota")
    with serve("--tenants", str(tenants(root)), "--data-dir", str(root / "data"),
               "--batch-max-files-per-tenant", "3", "--batch-max-file-bytes-per-tenant",
               "4000", "--batch-file-expiry", "2") as s:
        yield s, root / "data" / "files"


def test_file_quotas_refuse_in_openai_shape(quota_server: tuple[Server, Path]) -> None:
    server, _ = quota_server
    small = jsonl([line("q")])
    with client_for(server, ACME) as acme, client_for(server, OTHER) as other:
        # Bytes: one upload past the tenant's 4000 bytes.
        with pytest.raises(openai.BadRequestError) as err:
            acme.files.create(file=("big.jsonl", io.BytesIO(small * 60)), purpose="batch")
        assert assert_error_shape({"error": err.value.body})["code"] == "quota_exceeded"
        # Count: three files, then the fourth is refused; the other tenant is not affected.
        ids = [acme.files.create(file=("f.jsonl", io.BytesIO(small)), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": 3600}).id
               for _ in range(3)]
        with pytest.raises(openai.BadRequestError) as err:
            acme.files.create(file=("f.jsonl", io.BytesIO(small)), purpose="batch")
        assert err.value.body["code"] == "quota_exceeded"  # type: ignore[index]
        assert other.files.create(file=("f.jsonl", io.BytesIO(small)), purpose="batch").id
        # Deleting one makes room again.
        acme.files.delete(ids[0])
        acme.files.create(file=("f.jsonl", io.BytesIO(small)), purpose="batch")


def test_files_expire_and_are_deleted(quota_server: tuple[Server, Path]) -> None:
    server, files_dir = quota_server
    with client_for(server, OTHER) as other:
        bad_expiry: list[Any] = [{"anchor": "last_active_at", "seconds": 3600},
                                 {"anchor": "created_at", "seconds": 10**9}]
        for expires_after in bad_expiry:
            with pytest.raises(openai.BadRequestError) as err:
                other.files.create(file=("z.jsonl", io.BytesIO(jsonl([line("z")]))),
                                   purpose="batch", expires_after=expires_after)
            assert err.value.body["param"].startswith("expires_after")  # type: ignore[index]
        f = other.files.create(file=("x.jsonl", io.BytesIO(jsonl([line("x")]))),
                               purpose="batch")
        assert f.expires_at is not None and f.expires_at - f.created_at == 2
        kept = other.files.create(file=("y.jsonl", io.BytesIO(jsonl([line("y")]))),
                                  purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": 3600})
        assert kept.expires_at == kept.created_at + 3600
        assert (files_dir / f.id).exists()
        deadline = time.monotonic() + 10.0
        while (files_dir / f.id).exists():
            assert time.monotonic() < deadline, "the expired file was not deleted"
            time.sleep(0.1)
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(f.id)
        assert f.id not in [x.id for x in other.files.list()]
        assert other.files.retrieve(kept.id).id == kept.id


async def test_a_50000_line_batch_is_created_without_stalls(server: Server) -> None:
    data = jsonl([line(f"n{i}") for i in range(50_000)])

    async def both() -> tuple[int, Any]:
        status, f = await _upload(server.url, OTHER, data)
        assert status == 200, f
        return await _create(server.url, OTHER, f["id"])

    t0 = time.monotonic()
    work = asyncio.create_task(both())
    health = await _health_while(server.url, work)
    status, batch = work.result()
    print(f"\n50,000 lines uploaded and created in {time.monotonic() - t0:.1f}s: /health max "
          f"{max(health) * 1e3:.0f} ms over {len(health)} polls")
    assert status == 200 and batch["request_counts"]["total"] == 50_000, batch
    assert max(health) < HEALTH_BOUND_S, f"/health took up to {max(health):.3f}s"
    # Cancelled, the batch answers its 50,000 lines in its error file, also without stalls.
    with client_for(server, OTHER) as other:
        assert other.batches.cancel(batch["id"]).status in ("cancelling", "cancelled")
        ending = asyncio.create_task(asyncio.to_thread(wait_done, other, batch["id"], 60.0))
        health = await _health_while(server.url, ending)
        assert ending.result().status == "cancelled"
    print(f"cancelled: /health max {max(health) * 1e3:.0f} ms over {len(health)} polls")
    assert max(health) < HEALTH_BOUND_S, f"/health took up to {max(health):.3f}s"
