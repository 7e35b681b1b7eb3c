"""int4 layers without dense copies unpack their weights for big steps: the same function as the
packed kernel, a fallback where nothing can be built, and the loader's wiring."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from batcher.runtime import cpu_kernels, int4_unpack
from batcher.runtime.int4_unpack import UNPACK_ABOVE_ROWS, Int4Unpacker
from batcher.runtime.quant import INT4_GROUP, PackedLinear, attach_unpacker

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                              reason="no C compiler")


@pytest.fixture(scope="module")
def reads_layout(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether the C function reads torch's packed int4 layout on this CPU. Torch packs int4
    weights differently on some CPUs (those without AVX-512); there the start-up check turns
    unpacking off and every step runs the packed kernel (see the test of that below)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    built = Int4Unpacker(cpu_kernels.library(tmp_path_factory.mktemp("layout")))
    try:
        int4_unpack._check(built, INT4_GROUP)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def layout_read(reads_layout: bool) -> None:
    if not reads_layout:
        pytest.skip("torch's packed int4 layout on this CPU is not the one the C function reads")


@pytest.fixture(scope="module")
def unpacker(tmp_path_factory: pytest.TempPathFactory, reads_layout: bool) -> Int4Unpacker:
    if not reads_layout:
        pytest.skip("torch's packed int4 layout on this CPU is not the one the C function reads")
    u = int4_unpack.load(tmp_path_factory.mktemp("kernels"), INT4_GROUP)
    assert u is not None
    return u


@needs_cc
def test_where_the_layout_differs_unpacking_is_off(
        reads_layout: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from batcher.models.loader import load_model

    if reads_layout:
        pytest.skip("the C function reads this CPU's layout (the tests below cover it)")
    with caplog.at_level(logging.WARNING):
        assert int4_unpack.load(tmp_path / "k", INT4_GROUP) is None
    assert "packed layout" in caplog.text and "packed kernel" in caplog.text
    monkeypatch.setenv("BATCHER_CACHE", str(tmp_path))
    bare = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization="int4",
                      dense_above=None).model
    layers = [m for m in bare.modules() if isinstance(m, PackedLinear) and m.kind == "int4"]
    assert layers and all(m.unpack is None for m in layers)  # the packed kernel, every step
    x = torch.randn(UNPACK_ABOVE_ROWS + 8, layers[0].in_features, dtype=torch.bfloat16)
    assert layers[0](x).shape == (UNPACK_ABOVE_ROWS + 8, layers[0].out_features)


def _layer(n: int, k: int, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    return PackedLinear(lin, "int4", dense_above=None)


@needs_cc
def test_unpacked_weight_is_what_the_packed_kernel_multiplies_by(unpacker: Int4Unpacker) -> None:
    layer = _layer(192, 96)
    k, n = layer.in_features, layer.out_features
    eye = torch.eye(k, dtype=torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, INT4_GROUP,
                                                       layer.scales)
    got = unpacker.dense_t(layer.qweight, layer.scales, k, n, INT4_GROUP)
    assert got.shape == (k, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)


@needs_cc
def test_big_steps_unpack_small_ones_stay_packed(unpacker: Int4Unpacker) -> None:
    layer = _layer(128, 64, seed=1)
    reference = _layer(128, 64, seed=1)  # the same weights, never unpacked
    assert attach_unpacker(layer, unpacker) == 1 and layer.unpack is unpacker
    assert unpacker.above_rows == UNPACK_ABOVE_ROWS  # until calibrated
    for rows in (1, UNPACK_ABOVE_ROWS, UNPACK_ABOVE_ROWS + 1, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got, want = layer(x), reference(x)
        assert got.shape == (rows, 128)
        # The unpacked path rounds the weights to bf16 before an fp32-accumulated matmul.
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_cc
def test_layers_the_unpacker_cannot_take_keep_the_packed_kernel(unpacker: Int4Unpacker) -> None:
    odd = _layer(96, 64)  # 96 rows: not whole blocks of 64 in the packed layout
    with_copy = PackedLinear(nn.Linear(64, 128).to(torch.bfloat16), "int4", dense_above=8)
    model = nn.ModuleDict({"odd": odd, "copy": with_copy})
    assert attach_unpacker(model, unpacker) == 0
    assert odd.unpack is None and with_copy.unpack is None


def test_no_compiler_or_switched_off_means_the_packed_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("BATCHER_INT4_UNPACK", "0")
    assert int4_unpack.load(tmp_path, INT4_GROUP) is None
    monkeypatch.delenv("BATCHER_INT4_UNPACK")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="batcher.runtime.int4_unpack"):
        assert int4_unpack.load(tmp_path / "none", INT4_GROUP) is None
    assert "packed kernel" in caplog.text
    assert not list((tmp_path / "none").iterdir())  # no temporary file left either
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert int4_unpack.load(tmp_path / "other", INT4_GROUP) is None
    assert not list((tmp_path / "other").glob("*.so"))  # no half-built library left behind


@needs_cc
def test_a_library_built_ahead_serves_a_machine_with_no_compiler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout_read: None) -> None:
    built = cpu_kernels.build_portable(tmp_path)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    unpacker = int4_unpack.load(tmp_path, INT4_GROUP)  # checked against the packed kernel
    assert unpacker is not None and [p.name for p in tmp_path.glob("*.so")] == [built.name]
    assert int4_unpack.load(tmp_path / "empty", INT4_GROUP) is None


@needs_cc
def test_loader_attaches_it_only_without_dense_copies(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, layout_read: None) -> None:
    from batcher.models.loader import load_model

    monkeypatch.setenv("BATCHER_CACHE", str(tmp_path))
    bare = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization="int4",
                      dense_above=None).model
    copied = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization="int4",
                        dense_above=8).model
    assert all(isinstance(m.unpack, Int4Unpacker) for m in bare.modules()
               if isinstance(m, PackedLinear) and m.kind == "int4")
    assert all(m.unpack is None for m in copied.modules() if isinstance(m, PackedLinear))
    assert list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    unpack = next(m.unpack for m in bare.modules() if isinstance(m, PackedLinear) and m.unpack)
    assert unpack.above_rows == UNPACK_ABOVE_ROWS
    monkeypatch.setenv("BATCHER_INT4_UNPACK_ABOVE", "77")  # another CPU's crossover
    fixed = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization="int4",
                       dense_above=None).model
    assert {m.unpack.above_rows for m in fixed.modules()
            if isinstance(m, PackedLinear) and m.unpack} == {77}
