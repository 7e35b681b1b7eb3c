"""The fuzz suite of `test_fuzz.py` once more, every request through a router in front of the same
kind of replica: the router must be exactly as strict as the replica (one HTTP toolkit), so the
same pass figures hold (no 5xx but the by-design ones, errors in OpenAI's shape, a request ID on
every answer) and the router's log holds no traceback afterwards.

The test functions are the replica suite's own, collected here with this module's `client`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.fleet.procs import router, running, wait_http
from tests.reliability.test_fuzz import (  # noqa: F401 (collected here, with the fixtures below)
    Client,
    server,
    test_fuzz_any_method_and_path,
    test_fuzz_cancel,
    test_fuzz_chat_completions,
    test_fuzz_completions,
    test_fuzz_embeddings,
    test_fuzz_get_routes,
    test_fuzz_probe,
    test_server_still_serves_after_fuzzing,
)
from tests.server_process import Server


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Client]:  # noqa: F811 (this module's client: the router)
    rt = router("--log-level", "info", replicas=(server.url,))
    with running(rt):
        wait_http(rt.url + "/health", procs=(rt,))
        c = Client(rt.port)
        deadline = time.monotonic() + 30
        while c.send("GET", "/ready").status != 200:  # a health round has seen the replica
            assert time.monotonic() < deadline, rt.tail()
            time.sleep(0.1)
        yield c
        c.close()
        log = rt.tail(10**8)
    assert "Traceback" not in log, log[-5000:]
