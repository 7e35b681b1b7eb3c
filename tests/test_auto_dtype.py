"""`--dtype auto`: bfloat16 where the hardware computes it natively, float32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batcher.models import load_settings
from batcher.models.load_settings import cpu_has_fast_bf16, resolve_dtype


@pytest.mark.parametrize(("flags", "fast"), [
    ("fpu sse2 avx2 fma", False),  # AVX2 only: bf16 is emulated
    ("fpu avx2 avx512f avx512bw", False),  # AVX-512 without its bf16 extension
    ("fpu avx2 avx512f avx512_bf16", True),
    ("fpu avx2 amx_bf16 amx_tile", True),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, flags: str, fast: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n")
    assert cpu_has_fast_bf16(str(info)) is fast


def test_auto_is_float32_on_a_cpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16  # asked: given
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_auto_is_bfloat16_under_quantization_whatever_the_cpu(
        monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    """The packed kernels take bf16 activations; fp32 ones take a path 10x slower."""
    monkeypatch.setattr(load_settings, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu"), quantization) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu"), quantization) is torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), "none") is torch.float32


def test_no_cpuinfo_falls_back_to_what_torch_reports(tmp_path: Path) -> None:
    expected = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert cpu_has_fast_bf16(str(tmp_path / "missing")) is expected
