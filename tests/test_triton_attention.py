"""The fused paged decode kernel against the torch reference path: compiled for the GPU with
CUDA tensors where one is present, else on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, CPU tensors); skipped where Triton is not installed."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

MODULE = "batcher.runtime.triton_attention"
# The interpreter runs kernels on CPU tensors only, and a compiled kernel refuses them: each
# device gets the mode that accepts its tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter must be chosen before Triton's own modules are imported: where an earlier test
# (torch.compile) imported them compiled, the interpreted tests run in a fresh process instead.
CHILD = os.environ.get("BATCHER_TRITON_CHILD") == "1"


def compiled_already(module: str = MODULE, kernel: str = "_paged_decode_kernel") -> bool:
    """Triton's modules were imported here without the interpreter (asked when a test runs: an
    earlier test in the session may have imported them); `kernel` names one of `module`'s."""
    return DEVICE == "cpu" and not CHILD and "triton.language" in sys.modules and \
        type(sys.modules.get(module, None) and getattr(sys.modules[module], kernel, None)
             ).__name__ != "InterpretedFunction"


def run_interpreted(path: str) -> None:
    """Run the test file at `path` under the interpreter in a fresh process (the tests of a
    session that imported Triton compiled)."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "BATCHER_TRITON_CHILD": "1"}
    got = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          path], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-2000:]


def test_interpreted_in_a_fresh_process() -> None:
    if not compiled_already():
        pytest.skip("the interpreted tests run in this process")
    run_interpreted(__file__)


def assert_self_check_names_faults(mod, kernel_name: str, wrong, monkeypatch) -> None:
    """`mod.self_check` names a kernel `kernel_name` that computes wrongly (`wrong` standing in
    for it) and one that fails to compile, so the runner keeps torch attention."""
    dev = torch.device(DEVICE)
    monkeypatch.setattr(mod, kernel_name, wrong)
    assert "differs from torch attention" in mod.self_check(dev, torch.float32, 4, 2, 64, 16)

    def refused(*args, **kw):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(mod, kernel_name, refused)
    assert mod.self_check(dev, torch.float32, 4, 2, 64, 16) == "RuntimeError: cannot compile"


@contextlib.contextmanager
def kernel_module(module: str = MODULE, kernel: str = "_paged_decode_kernel"
                  ) -> Iterator[ModuleType]:
    """The kernels' module in the mode DEVICE needs. Triton reads TRITON_INTERPRET when
    `@triton.jit` runs, at the module's import: the module is imported again if it was imported
    in the other mode, and the variable is restored afterwards."""
    with kernel_modules((module, kernel)) as (mod,):
        yield mod


@contextlib.contextmanager
def kernel_modules(*pairs: tuple[str, str]) -> Iterator[list[ModuleType]]:
    """`kernel_module` for several (module, kernel) pairs at once, all checked before any is
    imported (importing one imports Triton, after which an unimported one counts as compiled)."""
    if any(compiled_already(module, kernel) for module, kernel in pairs):
        pytest.skip("Triton was imported compiled here; test_interpreted_in_a_fresh_process "
                    "runs these")
    interpret = "1" if DEVICE == "cpu" else "0"
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = interpret
    try:
        mods = []
        for module, kernel in pairs:
            mod = sys.modules.get(module)
            mod = importlib.import_module(module) if mod is None else importlib.reload(mod)
            interpreted = type(getattr(mod, kernel)).__name__ == "InterpretedFunction"
            assert interpreted == (DEVICE == "cpu"), type(getattr(mod, kernel))
            mods.append(mod)
        yield mods
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module")
def kernel():
    with kernel_module() as mod:
        yield mod.paged_decode_attention


@pytest.fixture(scope="module")
def tiny_on_device(tiny_fp32):
    """The tiny model on DEVICE (the session's CPU copy where there is no GPU)."""
    if DEVICE == "cpu":
        return tiny_fp32
    from batcher.models.loader import load_model

    return load_model("tiny", dtype="float32", device=DEVICE)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_kernel_matches_reference(kernel, heads, kv_heads):
    dev = DEVICE
    gen = torch.Generator().manual_seed(heads)
    d, bs, nb = 64, 16, 24
    kc = torch.randn(nb, bs, kv_heads, d, generator=gen).to(dev)
    vc = torch.randn(nb, bs, kv_heads, d, generator=gen).to(dev)
    q = torch.randn(4, heads, d, generator=gen).to(dev)
    lens = torch.tensor([1, 17, 40, 64], dtype=torch.int32, device=dev)
    tables = torch.tensor([[5, 0, 0, 0], [3, 9, 0, 0], [1, 4, 11, 0], [2, 6, 8, 23]],
                          dtype=torch.int32, device=dev)
    out = kernel(q, kc, vc, tables, lens)
    for i in range(4):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        k = kc[blocks].reshape(-1, kv_heads, d)[:n].repeat_interleave(heads // kv_heads, 1)
        v = vc[blocks].reshape(-1, kv_heads, d)[:n].repeat_interleave(heads // kv_heads, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], k.transpose(0, 1), v.transpose(0, 1))[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_runner_with_kernel_matches_torch_path(kernel, tiny_on_device):
    from batcher.runtime.model_runner import ModelRunner
    from tests.greedy_loop import greedy_generate

    assert tiny_on_device.device.type == DEVICE
    prompts = [[100 + i * 7 + j for j in range(10 + 5 * i)] for i in range(3)]
    ref = greedy_generate(ModelRunner(tiny_on_device, 32, 16, attention_backend="torch"),
                          prompts, 6)
    fused = ModelRunner(tiny_on_device, 32, 16, attention_backend="triton", cuda_graphs=False)
    assert fused.backend == "triton"
    assert greedy_generate(fused, prompts, 6) == ref
