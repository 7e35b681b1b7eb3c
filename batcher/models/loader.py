"""Load a model of a supported architecture (`batcher.models.arch`, `docs/models.md`) from one of
three sources behind one function.

- `smollm2-135m` (default): the bundled GGUF, dequantized to dense tensors (cached as safetensors
  in the user's cache folder after the first load, keyed by the file's hash and the dtype:
  `gguf_dense_cache`), or any other `.gguf` path of a supported architecture (`gguf_arch`); with
  int4, a Llama file's Q4_1 matrices are packed as stored (`gguf_int4`), no dense model is made;
- a local Hugging Face folder (`config.json` + `*.safetensors`, sharded or not, + tokenizer
  files: `hf_checkpoint`);
- `tiny`: a seeded random-weight model (2 layers, hidden 64, GQA) using the bundled tokenizer
  (`tiny`).

Device, dtype and quantization are resolved first (`load_settings`).

`load_format="dummy"` reads only a config (a shipped name such as `llama-3.1-8b`, the bundled
model's, a `config.json` or a folder holding one) and fills random weights in its shapes
(`batcher.models.dummy`), checked to fit the device first (`batcher.models.memory`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batcher.bundled import DEFAULT_MODEL, cache_root, smollm2_gguf_path
from batcher.core.config import LOAD_FORMATS
from batcher.models import dummy, gguf_weights
from batcher.models.errors import ModelLoadError
from batcher.models.glibc_heap import (
    LOAD_MMAP_THRESHOLD,
    SERVE_MMAP_THRESHOLD,
    release_free_memory,
    set_mmap_threshold,
)
from batcher.models.gguf_dense_cache import read_gguf_cached
from batcher.models.gguf_int4 import load_int4_gguf
from batcher.models.hf_checkpoint import build_from_hf_state, read_hf_config, read_hf_folder
from batcher.models.llama import LlamaConfig, LlamaModel, attach_fused
from batcher.models.llama_layer_loop import LayerLoop
from batcher.models.load_settings import resolve_device, resolve_dtype, resolve_quantization
from batcher.models.memory import check_fits
from batcher.models.tiny import tiny_config, tiny_state
from batcher.runtime import fused_decode, int4_unpack
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.quant import (
    INT4_GROUP,
    QUANTIZATIONS,
    QUANTIZED_LINEARS,
    attach_unpacker,
    quantize_model,
)
from batcher.system.threads import release_openmp_pool

log = logging.getLogger(__name__)

# Quantized steps with more rows than this use a dense copy of the (quantized) weights: the packed
# kernels win at a few rows and lose to the dense matmul at a few dozen (BENCHMARKS.md).
DENSE_ABOVE_ROWS: int | None = 8


@dataclass(slots=True)
class LoadedModel:
    name: str
    model: LlamaModel
    config: LlamaConfig
    dtype: torch.dtype
    device: torch.device
    tokenizer_source: Path  # a .gguf file or a Hugging Face folder
    load_seconds: float
    quantization: str = "none"
    # CPU, bf16: the C kernels its norms run small steps with, and decode steps' attention
    # (`batcher.runtime.fused_decode`); None where they cannot be built or do not apply.
    fused: FusedDecode | None = None


def load_model(source: str = DEFAULT_MODEL, dtype: str | torch.dtype | None = "auto",
               device: str | None = "auto", seed: int = 0, quantization: str = "none",
               dense_above: int | None = DENSE_ABOVE_ROWS,
               int4_via_dense: bool = False, load_format: str = "auto") -> LoadedModel:
    """Load `source` (a name, a .gguf path or a Hugging Face folder) onto `device` in `dtype`.
    `quantization` int8/int4 packs the decoder layers' linears (CPU only; `auto`: see
    `resolve_quantization`); steps with more than
    `dense_above` rows use a dense copy of the quantized weights (None: no copy of the layers; a
    tied int8 head keeps its copy past HEAD_DENSE_ABOVE_ROWS rows either way). int4 from a
    GGUF file takes its Q4_1 blocks as they are; `int4_via_dense` instead dequantizes the whole
    model and re-quantizes it (the slower, larger load, kept to compare the two).
    `load_format` "dummy" reads only `source`'s config (see `dummy_config`) and builds random
    weights in its shapes on `device`, with the bundled tokenizer; `auto` reads the weights."""
    start = time.perf_counter()
    set_mmap_threshold(LOAD_MMAP_THRESHOLD)  # before the first large tensor is freed
    quantization_done = False
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unsupported load format {load_format!r}; "
                             f"choose one of {list(LOAD_FORMATS)}")
    dev = resolve_device(device)
    if load_format == "dummy" and quantization == "auto":
        quantization = "none"  # no file's blocks to keep; int8/int4 still quantize on request
    quantization = resolve_quantization(quantization, source, dtype, dev)
    dt = resolve_dtype(dtype, dev, quantization)
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unsupported quantization {quantization!r}; "
                             f"choose one of {list(QUANTIZATIONS)}")
    if quantization != "none" and dev.type != "cpu":
        raise ModelLoadError("--quantization int8/int4 runs on the CPU only; use none on "
                             f"{dev.type}")
    if source == "tiny":
        tok_src = smollm2_gguf_path()
        cfg = tiny_config()
        model = build_from_hf_state(cfg, tiny_state(cfg, seed), dt, dev)
        name = "tiny"
    elif load_format == "dummy":
        name, cfg = dummy_config(source)
        check_fits(name, cfg, dt, dev)
        model = dummy.build_random(cfg, dt, dev, seed)
        # The bundled tokenizer; a larger vocabulary in the config is masked past its ids
        # (`ModelRunner.attach_tokenizer`).
        tok_src = smollm2_gguf_path()
    else:
        path = smollm2_gguf_path() if source == DEFAULT_MODEL else Path(source).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path not found: {source}")
        if path.is_dir():
            cfg, state = read_hf_folder(path, dt, dev)
            name = path.name
        elif path.suffix == ".gguf":
            name = DEFAULT_MODEL if source == DEFAULT_MODEL else path.stem
            # Q4_1 blocks as stored go into Llama's layers only (the bundled model is one).
            if (quantization == "int4" and not int4_via_dense
                    and (source == DEFAULT_MODEL
                         or gguf_weights.read_gguf_config(path).is_llama)):
                # Straight from the file's Q4_1 blocks: no dense model, no weight cache.
                cfg, model = _load_int4_gguf(path, dt, dense_above, name)
                quantization_done = True
            else:
                cfg, state = read_gguf_cached(path, dt)
        else:
            raise ModelLoadError(f"not a model folder or a .gguf file: {source}")
        tok_src = path
        if not quantization_done:
            model = build_from_hf_state(cfg, state, dt, dev)
            del state  # the dense tensors the model does not hold (quantized below)
    if not quantization_done:
        try:
            quantize_model(model, quantization, dense_above)
        except ValueError as exc:  # a shape the packed kernels cannot take
            raise ModelLoadError(f"cannot quantize {name} to {quantization}: {exc}") from exc
    release_free_memory()
    set_mmap_threshold(SERVE_MMAP_THRESHOLD)
    if quantization == "int4" and dense_above is None:
        _attach_int4_unpacker(model)
    # The fused kernels implement Llama's attention only (`LlamaConfig.plain_attention`).
    fused = (_attach_fused(model) if dev.type == "cpu" and dt == torch.bfloat16
             and cfg.plain_attention else None)
    if dev.type == "cuda" and dt != torch.float32:
        _attach_gpu_layer_loop(model, dev, dt)
    release_openmp_pool()  # steps run on another thread, whose pool must be the only one
    took = time.perf_counter() - start
    log.info("loaded %s (%s, %s, quantization %s) in %.2fs", name, dt, dev, quantization, took)
    return LoadedModel(name, model, cfg, dt, dev, tok_src, took, quantization, fused)


def _attach_fused(model: LlamaModel) -> FusedDecode | None:
    """Small bf16 steps on the CPU run the norms, and decode steps the attention, as C kernels
    (`batcher.runtime.fused_decode`) where the machine can build them."""
    kernels = fused_decode.load(cache_root() / "kernels")
    if kernels is None:
        return None
    n = attach_fused(model, kernels)
    cfg = model.config
    attends = kernels.takes_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    model.layer_loop = (LayerLoop.for_model(model, kernels)
                        if attends and layer_loop_wanted() else None)
    log.info("fused CPU kernels: %d norms%s%s", n,
             ", and decode steps' attention" if attends else " (attention: heads do not fit)",
             "; small decode steps run as one loop over the layers" if model.layer_loop else "")
    return kernels if attends else None


def layer_loop_wanted() -> bool:
    """`BATCHER_LAYER_LOOP=0` keeps every step on the modules' path, to compare."""
    return os.environ.get("BATCHER_LAYER_LOOP", "1") != "0"


def _attach_gpu_layer_loop(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """A plain model's steps on a GPU run the ops between its matmuls as Triton kernels
    (`batcher.runtime.triton_norms`) where Triton is installed and they agree with torch's ops
    on this device in the model's sizes."""
    if not layer_loop_wanted() or importlib.util.find_spec("triton") is None:
        return
    try:
        from batcher.runtime import triton_norms
    except Exception as exc:  # noqa: BLE001 (a Triton that is installed but cannot load)
        log.warning("Triton cannot load (%s: %s): steps run the model's modules",
                    type(exc).__name__, exc)
        return

    loop = LayerLoop.for_model(model, triton_norms.TritonLayerOps())
    if loop is None:
        return
    cfg = model.config
    why = triton_norms.self_check(device, dtype, cfg.hidden_size, cfg.intermediate_size)
    if why is not None:
        log.warning("the Triton norm kernels failed their start-up check (%s): steps run the "
                    "model's modules", why)
        return
    why = triton_norms.check_rope_cache(device, dtype, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim)
    if why is not None:
        loop.rope_cache = None
        log.info("RoPE and the cache write stay torch's ops in the layer loop (%s)", why)
    model.layer_loop = loop
    log.info("steps run as one loop over the layers, norms and SwiGLU as Triton kernels%s",
             "" if loop.rope_cache is None else
             "; with the triton attention backend, RoPE and the cache write too")


def _attach_int4_unpacker(model: LlamaModel) -> None:
    """Without dense copies, big steps unpack each int4 layer into a reused dense buffer
    (`batcher.runtime.int4_unpack`) where the machine can build the small C function for it."""
    unpacker = int4_unpack.load(cache_root() / "kernels", INT4_GROUP)
    if unpacker is None:
        return
    n = attach_unpacker(model, unpacker)
    log.info("int4: %d linears unpack to bf16 for steps of more than %d rows", n,
             unpacker.above_rows)


def _load_int4_gguf(path: Path, dtype: torch.dtype, dense_above: int | None, name: str
                    ) -> tuple[LlamaConfig, LlamaModel]:
    try:
        cfg, model, direct = load_int4_gguf(path, dtype, dense_above)
    except ValueError as exc:  # a shape the packed kernels cannot take
        raise ModelLoadError(f"cannot quantize {name} to int4: {exc}") from exc
    log.info("int4: %d of %d linears taken from Q4_1 blocks as stored", direct,
             len(QUANTIZED_LINEARS) * cfg.num_layers)
    return cfg, model


def dummy_config(source: str) -> tuple[str, LlamaConfig]:
    """The name and config `load_format="dummy"` builds for `source`: a shipped config
    (`dummy.config_names()`), the bundled model's (from its file's header), a .gguf file's
    header, a Hugging Face `config.json`, or a folder of which only config.json is read."""
    shipped = dummy.shipped_config(source)
    if shipped is not None:
        return source, read_hf_config(shipped)
    if source == DEFAULT_MODEL:
        return source, gguf_weights.read_gguf_config(smollm2_gguf_path())
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve().name, read_hf_config(path / "config.json")
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, gguf_weights.read_gguf_config(path)
    if path.is_file() and path.suffix == ".json":
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return name, read_hf_config(path)
    names = ", ".join([*dummy.config_names(), DEFAULT_MODEL])
    raise ModelLoadError(f"--load-format dummy takes a config name ({names}), a config.json or "
                         f"a folder holding one; got {source!r}")
