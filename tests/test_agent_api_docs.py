"""The Python examples in docs/agent-apis.md, run as written (each block in its own interpreter,
the server's address in BATCHER_BASE_URL, which the examples read) with the official `openai` and
`anthropic` clients against a `batcher serve` process on the bundled model at default settings,
then through a `batcher router` process in front of it; both count the requests by route.

The same process first checks the metrics contract on the bundled model (one start of the model
for both: the contract needs a server nothing has run on yet, so that test comes first)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.fleet.procs import Proc, router, running, wait_http
from tests.server_process import ROOT, Server, serve
from tests.test_metrics_contract import check_contract, labelled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
DOC = ROOT / "docs" / "agent-apis.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# Loopback only: the examples' HTTP clients must not go through a proxy from the environment.
PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy"}


def examples() -> list[str]:
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) == 2, "one example per API"
    return blocks


def run_examples(url: str) -> list[str]:
    """Each example's output; a failing one fails the test with its traceback."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARS}
    env.update(BATCHER_BASE_URL=url, NO_PROXY="127.0.0.1,localhost")
    outputs = []
    for code in examples():
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"the example failed:\n{code}\n{done.stderr}"
        outputs.append(done.stdout)
    return outputs


def check_outputs(outputs: list[str]) -> None:
    openai_out, anthropic_out = outputs
    # The forced tool calls are greedy, so their names and arguments are known.
    assert 'get_weather {"city": "Paris"}' in openai_out, openai_out
    assert "get_weather {'city': 'Paris'}" in anthropic_out, anthropic_out
    assert anthropic_out.splitlines()[-1].isdigit()  # count_tokens


def requests_by_route(url: str, name: str) -> dict[str, float]:
    """route -> requests answered 200, from `url`'s /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {dict(labels)["route"]: value for labels, value in labelled(text, name).items()
            if dict(labels)["status"] == "200"}


@pytest.fixture(scope="module")
def replica() -> Iterator[Server]:
    with serve("--model", MODEL, "--embedding-model", "none", num_blocks=None,
               ready_timeout=180.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def router_proc(replica: Server) -> Iterator[Proc]:
    rt = router(replicas=(replica.url,))
    with running(rt):
        wait_http(rt.url + "/ready", procs=(rt,))
        yield rt


def test_metrics_contract_on_the_bundled_model(replica: Server) -> None:
    check_contract(replica.url, MODEL, None)


def test_documented_examples_against_serve(replica: Server) -> None:
    check_outputs(run_examples(replica.url))
    counted = requests_by_route(replica.url, "batcher_requests_by_route_total")
    assert counted["/v1/responses"] == 4 and counted["/v1/messages"] == 4
    assert counted["/v1/messages/count_tokens"] == 1


def test_documented_examples_through_the_router(replica: Server, router_proc: Proc) -> None:
    check_outputs(run_examples(router_proc.url))
    counted = requests_by_route(router_proc.url, "batcher_router_requests_by_route_total")
    assert counted["/v1/responses"] == 4 and counted["/v1/messages"] == 4
    assert counted["/v1/messages/count_tokens"] == 1
    # The replica counted them again, under the same routes.
    counted = requests_by_route(replica.url, "batcher_requests_by_route_total")
    assert counted["/v1/responses"] == 8 and counted["/v1/messages"] == 8
