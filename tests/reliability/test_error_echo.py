"""What a client sends is echoed back bounded.

Pass figure: a 3 MB `input_file_id` gets its 404 in under 4 KB from replica and router, and so
does a 7,000-character file id in a path.

One tiny-model replica with the batch API and a router in front of it, on 127.0.0.1, started and
stopped by this module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.fleet.procs import Proc, router, running, wait_http
from tests.server_process import Server, assert_error_shape, serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HUGE_ID = "file-" + "x" * 3_000_000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Proc]]:
    data = Path(tmp_path_factory.mktemp("echo-data"))
    with serve("--data-dir", str(data)) as rep:
        rt = router("--log-level", "info", replicas=(rep.url,))
        with running(rt):
            wait_http(rt.url + "/ready", procs=(rt,))
            yield rep, rt


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def test_huge_ids_are_not_echoed_whole(fleet: tuple[Server, Proc],
                                             session: aiohttp.ClientSession) -> None:
    body = orjson.dumps({"input_file_id": HUGE_ID, "endpoint": "/v1/completions",
                         "completion_window": "24h"})
    for base in (fleet[0].url, fleet[1].url):
        async with session.post(base + "/v1/batches", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            assert resp.status in (400, 404), (base, resp.status, raw[:200])
            assert len(raw) < 4096, (base, len(raw))
            assert_error_shape(orjson.loads(raw))
        async with session.get(f"{base}/v1/files/{HUGE_ID[:7000]}") as resp:
            raw = await resp.read()
            assert resp.status in (400, 404, 414), (base, resp.status, raw[:200])
            assert len(raw) < 4096, (base, len(raw))
