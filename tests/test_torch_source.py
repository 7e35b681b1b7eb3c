"""`scripts/setup`'s choice of torch build: the CPU index without a GPU, PyPI's CUDA build with
one, an explicit override, and a pip the user pointed at a mirror left alone. The decision only;
nothing is downloaded."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts/torch_source.py")
assert _spec is not None and _spec.loader is not None
torch_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_source)
CPU = [torch_source.TORCH, "--index-url", torch_source.CPU_INDEX]
PLAIN = [torch_source.TORCH]


@pytest.mark.parametrize(("env", "cuda", "config", "expected"), [
    ({}, False, [], CPU),
    ({}, True, [], PLAIN),
    ({"BATCHER_TORCH_INDEX_URL": "https://example.test/cu124"}, False, [],
     [torch_source.TORCH, "--index-url", "https://example.test/cu124"]),
    ({"BATCHER_TORCH_INDEX_URL": "pypi"}, False, [], PLAIN),
    ({"BATCHER_TORCH_INDEX_URL": " "}, False, [], CPU),
    ({"PIP_INDEX_URL": "https://mirror.test/simple"}, False, [], PLAIN),
    ({"PIP_FIND_LINKS": "/opt/wheels"}, False, [], PLAIN),
    ({}, False, ["global.extra-index-url='file:///opt/pypi/simple'"], PLAIN),
    ({}, False, ["global.cert='/etc/ssl/certs/ca.crt'", "global.timeout='60'"], CPU),
])
def test_choice(env: dict[str, str], cuda: bool, config: list[str],
                expected: list[str]) -> None:
    assert torch_source.choose(env, cuda, config) == expected


def test_script_prints_pip_arguments() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/torch_source.py"), sys.executable],
                         capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.split()
    assert lines[0] == torch_source.TORCH
    assert lines in (CPU, PLAIN) or lines[1] == "--index-url"
