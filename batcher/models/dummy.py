"""Random weights in a real model's shapes (`--load-format dummy`): a server, a benchmark or a
GPU check can run 8B-sized steps without downloading 16 GB of weights. The text it generates
is meaningless; its step times, memory and KV cache are the real model's.

The configs shipped in `configs/` are the published Hugging Face `config.json` numbers of a
few common models (`config_names()`); any other `config.json` works as well.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batcher.models.llama import LlamaConfig, LlamaModel
from batcher.models.variants import build_model

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Small enough that activations stay finite in bf16/fp16 through every layer (each projection's
# output is ~std * sqrt(fan_in) times its normalised input), the usual initialisation scale.
INIT_STD = 0.02


def config_names() -> list[str]:
    """Names of the shipped configs (`llama-3.1-8b`, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def shipped_config(name: str) -> Path | None:
    """The shipped config.json of `name`, or None."""
    path = CONFIG_DIR / f"{name}.json"
    return path if name in config_names() else None


def build_random(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> LlamaModel:
    """A model of `cfg`'s shapes whose every weight is made once, on `device` in `dtype`, and
    filled there in place: normal(0, INIT_STD) matrices, norms at 1, biases at 0. Nothing passes
    through the CPU (an 8B model builds on a GPU in about a second)."""
    with torch.device("meta"):
        model = build_model(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, meta in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding table, tied below
        t = torch.empty(meta.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, INIT_STD, generator=gen)
        state[name] = t
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
