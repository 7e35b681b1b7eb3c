"""The device, dtype and quantization a model loads with: a name checked, or `auto` resolved
for this machine and this model file."""

from __future__ import annotations

from pathlib import Path

import torch

from batcher.bundled import smollm2_gguf_path
from batcher.system.cpuinfo import CPUINFO, cpuinfo_field
from batcher.bundled import DEFAULT_MODEL
from batcher.models import gguf_weights
from batcher.models.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def cpu_has_fast_bf16(cpuinfo: str = CPUINFO) -> bool:
    """The CPU computes bfloat16 natively (AVX-512 BF16 or AMX on x86, read from
    /proc/cpuinfo; on other systems: torch's build reports AVX-512). Without it torch converts
    to fp32 around every product: on an AVX2 CPU a bf16 step of 8 decode rows is ~2.7x slower
    than fp32, of 64 rows ~6x (one stream is ~0.8x: weight reads dominate)."""
    flags = cpuinfo_field("flags", path=cpuinfo)
    if flags is not None:
        return bool(set(flags.split()) & {"avx512_bf16", "amx_bf16"})
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  quantization: str = "none") -> torch.dtype:
    """`auto` is bfloat16 on a GPU and on a CPU with native bf16 (about 2x faster than fp32
    there), else float32 (`cpu_has_fast_bf16`), except under int8/int4 quantization: PyTorch's
    packed CPU kernels take bfloat16 activations, and given fp32 ones they run 10-13x slower
    (one decode row of the bundled model's MLP on an AVX2 CPU: int4 1.81 ms with fp32, 0.14 ms
    with bf16; dense fp32 0.22 ms)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        if device.type == "cpu" and quantization == "none" and not cpu_has_fast_bf16():
            return torch.float32
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_quantization(quantization: str, source: str, dtype: str | torch.dtype | None,
                         device: torch.device) -> str:
    """`auto` is int4 where it wins: a GGUF file whose decoder weights are Q4_1 blocks (the
    bundled model), run in bfloat16 on a CPU that computes it natively. The int4 kernels then
    read the file's own blocks, a quarter of bf16's bytes per token (one stream about 2x faster
    on the bundled model), and big steps run a dense bf16 matmul as `none` does, on a dense
    copy or on weights unpacked per step (BENCHMARKS.md); greedy output then differs from
    `none`'s at near-ties (the same Q4_1 weights, rounded differently). Anything else resolves
    to none: on a CPU without native bf16 the int4 kernels would force bf16 onto the dense
    batch path (3-6x slower than fp32 there), float32 asks for the reference path, a GPU has
    no int4 kernel here, and a dense checkpoint has no blocks to keep."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu" or not cpu_has_fast_bf16():
        return "none"
    if resolve_dtype(dtype, device, "int4") is not torch.bfloat16:
        return "none"
    path = smollm2_gguf_path() if source == DEFAULT_MODEL else Path(source).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return "none"
    return "int4" if gguf_weights.mostly_q4_1(path) else "none"
