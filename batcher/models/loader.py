"""Load a model of a supported architecture (`batcher.models.arch`, `docs/models.md`) from one of
three sources behind one function.

- `smollm2-135m` (default): the bundled GGUF, dequantized to dense tensors (cached as safetensors
  in the user's cache folder after the first load, keyed by the file's hash and the dtype), or any
  other `.gguf` path of a supported architecture (`gguf_arch`); with int4, a Llama file's Q4_1
  matrices are packed as stored (`gguf_int4`), no dense model is made;
- a local Hugging Face folder (`config.json` + `*.safetensors`, sharded or not, + tokenizer
  files);
- `tiny`: a seeded random-weight model (2 layers, hidden 64, GQA) using the bundled tokenizer.

`load_format="dummy"` reads only a config (a shipped name such as `llama-3.1-8b`, the bundled
model's, a `config.json` or a folder holding one) and fills random weights in its shapes
(`batcher.models.dummy`), checked to fit the device first (`batcher.models.memory`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from batcher.bundled import smollm2_gguf_path
from batcher.cpuinfo import CPUINFO, cpuinfo_field
from batcher.engine_config import LOAD_FORMATS
from batcher.models import arch, dummy, gguf_weights
from batcher.models.errors import ModelLoadError
from batcher.models.gguf_int4 import load_int4_gguf
from batcher.models.llama import LlamaConfig, LlamaModel, attach_fused
from batcher.models.memory import check_fits
from batcher.models.variants import build_model
from batcher.runtime import fused_decode, int4_unpack
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.quant import (
    INT4_GROUP,
    QUANTIZATIONS,
    QUANTIZED_LINEARS,
    attach_unpacker,
    quantize_model,
)
from batcher.threads import release_openmp_pool

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = set(arch.ARCHITECTURES)
# Quantized steps with more rows than this use a dense copy of the (quantized) weights: the packed
# kernels win at a few rows and lose to the dense matmul at a few dozen (BENCHMARKS.md).
DENSE_ABOVE_ROWS: int | None = 8
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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


def cache_dir() -> Path:
    root = os.environ.get("BATCHER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batcher")
    return Path(root)


def load_model(source: str = DEFAULT_MODEL, dtype: str | torch.dtype | None = "auto",
               device: str | None = "auto", seed: int = 0, quantization: str = "none",
               dense_above: int | None = DENSE_ABOVE_ROWS,
               int4_via_dense: bool = False, load_format: str = "auto") -> LoadedModel:
    """Load `source` (a name, a .gguf path or a Hugging Face folder) onto `device` in `dtype`.
    `quantization` int8/int4 packs the decoder layers' linears (CPU only; `auto`: see
    `resolve_quantization`); steps with more than
    `dense_above` rows use a dense copy of the quantized weights (None: no copy). int4 from a
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
        model = _build(cfg, _tiny_state(cfg, seed), dt, dev)
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
            cfg, state = _read_hf_folder(path, dt, dev)
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
                cfg, state = _read_gguf_cached(path, dt)
        else:
            raise ModelLoadError(f"not a model folder or a .gguf file: {source}")
        tok_src = path
        if not quantization_done:
            model = _build(cfg, state, dt, dev)
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
    release_openmp_pool()  # steps run on another thread, whose pool must be the only one
    took = time.perf_counter() - start
    log.info("loaded %s (%s, %s, quantization %s) in %.2fs", name, dt, dev, quantization, took)
    return LoadedModel(name, model, cfg, dt, dev, tok_src, took, quantization, fused)


def _attach_fused(model: LlamaModel) -> FusedDecode | None:
    """Small bf16 steps on the CPU run the norms, and decode steps the attention, as C kernels
    (`batcher.runtime.fused_decode`) where the machine can build them."""
    kernels = fused_decode.load(cache_dir() / "kernels")
    if kernels is None:
        return None
    n = attach_fused(model, kernels)
    cfg = model.config
    attends = kernels.takes_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    log.info("fused CPU kernels: %d norms%s", n,
             ", and decode steps' attention" if attends else " (attention: heads do not fit)")
    return kernels if attends else None


def _attach_int4_unpacker(model: LlamaModel) -> None:
    """Without dense copies, big steps unpack each int4 layer into a reused dense buffer
    (`batcher.runtime.int4_unpack`) where the machine can build the small C function for it."""
    unpacker = int4_unpack.load(cache_dir() / "kernels", INT4_GROUP)
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


# glibc's mallopt parameters: the size from which a block gets a mapping of its own, and how much
# free memory at the top of the heap it keeps.
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
# While loading: glibc's initial 128 KiB, so the weights' load-time temporaries are unmapped when
# freed. While serving: 1 MiB, so a step's small activations are reused from the heap (no page
# faults) while logits and large prefill blocks are returned when freed.
LOAD_MMAP_THRESHOLD = 128 * 1024
SERVE_MMAP_THRESHOLD = 1024 * 1024


def set_mmap_threshold(size: int) -> None:
    """Fix glibc's mmap threshold at `size` bytes (and its trim threshold at twice that, the ratio
    glibc keeps itself). By default the threshold rises to the size of each large block freed (up
    to 32 MiB), after which blocks of that size (load-time weights; logits and activations of big
    steps) come from the heap and their pages stay resident once freed. Measured on the bundled
    model, int4 without dense copies, one server after one request: 450-470 MiB resident by
    default, 427 MiB with 128 KiB while loading only, 393 MiB with 1 MiB after it; the 1 MiB
    threshold kept the decode step's CPU time (batch 1 and 32) and cost a 256-token prefill about
    4% (`BENCHMARKS.md`). Left alone when MALLOC_MMAP_THRESHOLD_ sets it from the environment."""
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, size)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * size)
    except (OSError, AttributeError):  # not glibc
        pass


def release_free_memory() -> None:
    """Hand the heap pages freed by loading back to the OS. glibc keeps freed blocks below its
    mmap threshold (which rises to 32 MiB as large tensors are freed) in the heap, so a load that
    made and dropped dense tensors would otherwise stay resident at its peak."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def tiny_config() -> LlamaConfig:
    # The bundled tokenizer's vocabulary, so tests can feed real text.
    return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_ids=(2,))


def _tiny_state(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face names. A wide init keeps greedy choices away from
    near-ties, so batch composition cannot flip them."""
    gen = torch.Generator().manual_seed(seed)
    hf = _hf_shapes(cfg)
    state = {}
    for name, shape in hf.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) * (1.0 / shape[-1] ** 0.5)
    return state


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                   p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                   p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                   p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return shapes


# The image side of an image-text checkpoint, which a text server leaves out.
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


def fuse_hf_state(cfg: LlamaConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours: drop the `model.` prefix, fuse q/k/v and gate/up (Phi-3's
    come fused), and stack each sparse layer's experts (`batcher.models.moe`): Mixtral's
    `block_sparse_moe.experts.N.w1/w3/w2`, Qwen-MoE's `mlp.experts.N.gate/up/down_proj`, or
    transformers 5's own stacked `mlp.experts.gate_up_proj/down_proj`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if "rotary_emb" in name or name.startswith(_NOT_TEXT):
            continue
        if name.startswith(("language_model.", "model.language_model.")):
            # An image-text checkpoint's language model: `language_model.model.*` on the Hub,
            # `model.language_model.*` as transformers 5 names it.
            name = name.replace("language_model.", "", 1)
        out[name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")] = t
    for n in cfg.moe_layers if cfg.num_experts else ():
        p = f"layers.{n}.mlp."
        if p + "experts.gate_up_proj" in out:
            out[p + "experts_gate_up"] = out.pop(p + "experts.gate_up_proj")
            out[p + "experts_down"] = out.pop(p + "experts.down_proj")
            continue
        gate_up, down = [], []
        for e in range(cfg.num_experts):
            q = f"{p}experts.{e}."
            if q + "w1.weight" in out:  # Mixtral: w1 gate, w3 up, w2 down
                gate_up.append(torch.cat([out.pop(q + "w1.weight"), out.pop(q + "w3.weight")]))
                down.append(out.pop(q + "w2.weight"))
            elif q + "gate_proj.weight" in out:
                gate_up.append(torch.cat([out.pop(q + "gate_proj.weight"),
                                          out.pop(q + "up_proj.weight")]))
                down.append(out.pop(q + "down_proj.weight"))
        if len(down) == cfg.num_experts:
            out[p + "experts_gate_up"] = torch.stack(gate_up)  # [experts, 2 * inter, hidden]
            out[p + "experts_down"] = torch.stack(down)  # [experts, hidden, inter]
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{p}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
            if all(x is not None for x in parts):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, 0)
        for mlp in (f"{p}mlp.", f"{p}mlp.shared_expert."):
            if mlp + "gate_proj.weight" in out:
                gate, up = out.pop(mlp + "gate_proj.weight"), out.pop(mlp + "up_proj.weight")
                out[mlp + "gate_up_proj.weight"] = torch.cat([gate, up], 0)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _build(cfg: LlamaConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = build_model(cfg)
    state = fuse_hf_state(cfg, hf_state)
    missing = set(model.state_dict()) - set(state)
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


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


def read_hf_config(cfg_path: Path) -> LlamaConfig:
    """A Hugging Face `config.json` of a supported architecture."""
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path.parent} has no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
        archs = set(raw.get("architectures") or [])
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_path}: {exc}") from exc
    if not archs & SUPPORTED_ARCHITECTURES:
        raise arch.unsupported(sorted(archs) or raw.get("model_type"))
    try:
        return arch.config_from_hf(raw)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        # transformers' config class refuses fields it cannot take with a ValueError.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{cfg_path}: missing or bad field {first}") from exc


def _read_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device
                    ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = read_hf_config(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weight files")
    check_fits(folder.name, cfg, dtype, device)  # before reading gigabytes of weights
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: read the shards its index names
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        files = [folder / n for n in names]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if arch.ARCHITECTURES.get(cfg.architecture) in arch.NORM_PLUS_ONE:
        # Gemma scales by (1 + weight); the model's RMSNorm by its weight.
        state = {k: v.float() + 1 if k.endswith("norm.weight") else v for k, v in state.items()}
    return cfg, state


def _read_gguf_cached(path: Path, dtype: torch.dtype) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Dequantizing takes seconds; later loads read the dense safetensors cache instead."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    digest = _file_digest(path)
    dtype_name = str(dtype).removeprefix("torch.")
    cached = cache_dir() / "weights" / f"{path.stem}-{digest[:16]}-{dtype_name}.safetensors"
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as f:
                cfg = _config_from_json(f.metadata()["config"])
                return cfg, {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except Exception as exc:  # noqa: BLE001 (a torn or stale cache file: rebuild it)
            log.warning("ignoring unreadable weight cache %s: %s", cached.name, exc)
    cfg, state = gguf_weights.read_gguf(path)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_file(state, str(tmp), metadata={"config": json.dumps(asdict(cfg))})
        os.replace(tmp, cached)  # atomic: concurrent replicas never read a half-written file
    except OSError as exc:
        log.warning("could not write the weight cache: %s", exc)
    return cfg, state


def _config_from_json(text: str) -> LlamaConfig:
    raw = json.loads(text)
    for key in ("eos_token_ids", "sliding_layers", "moe_layers"):
        raw[key] = tuple(raw.get(key) or ())
    return LlamaConfig(**raw)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
