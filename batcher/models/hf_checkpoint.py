"""A Hugging Face checkpoint as our model: its `config.json` of a supported architecture, its
safetensors (sharded or not), and weights in its names mapped, fused and stacked into ours."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batcher.models import arch
from batcher.models.errors import ModelLoadError
from batcher.models.llama import LlamaConfig, LlamaModel
from batcher.models.memory import check_fits
from batcher.models.variants import build_model

SUPPORTED_ARCHITECTURES = set(arch.ARCHITECTURES)

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


def build_from_hf_state(cfg: LlamaConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype,
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


def read_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device
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
