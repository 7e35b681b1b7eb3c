"""A GGUF file's weights dequantized once and kept as safetensors in the user's cache folder
(`batcher.bundled.cache_root()`, which also holds the CPU kernels built at start-up), keyed by
the file's hash and the dtype."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from batcher.bundled import cache_root
from batcher.models import gguf_weights
from batcher.models.llama import LlamaConfig

log = logging.getLogger(__name__)


def read_gguf_cached(path: Path, dtype: torch.dtype) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Dequantizing takes seconds; later loads read the dense safetensors cache instead."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    digest = _file_digest(path)
    dtype_name = str(dtype).removeprefix("torch.")
    cached = cache_root() / "weights" / f"{path.stem}-{digest[:16]}-{dtype_name}.safetensors"
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
