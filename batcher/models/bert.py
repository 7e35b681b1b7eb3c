"""A BERT encoder (the architecture of sentence-embedding models such as all-MiniLM-L6-v2), read
from a Hugging Face folder's config.json and safetensors weights.

Inference only, absolute positions, post-norm layers, GELU: what `BertModel` computes for its
last hidden state, without importing `transformers` (whose modelling code would cost a serving
process more resident memory than the bundled embedding model's weights; `tests/test_embeddings`
compares the two).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batcher.models.errors import ModelLoadError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        if cfg.get("model_type") != "bert":
            raise ModelLoadError(f"not a BERT model: model_type {cfg.get('model_type')!r}")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(f"unsupported activation {cfg['hidden_act']!r} (gelu only)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError("only absolute position embeddings are supported")
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   intermediate_size=cfg["intermediate_size"],
                   max_positions=cfg["max_position_embeddings"],
                   type_vocab_size=cfg.get("type_vocab_size", 2),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]; mask: [B, 1, 1, T] bool, True where a key is a real token.
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, T, head_dim]
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    """ids, token types and an attention mask ([B, T] each) -> the last hidden state [B, T, H]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        # Uninitialised, as `LlamaModel`'s table: the loader assigns every weight, and
        # nn.Embedding's own random init on the meta device costs ~65 MiB resident per process.
        self.word, self.position, self.token_type = (
            nn.Embedding(n, cfg.hidden_size, _weight=torch.empty(n, cfg.hidden_size))
            for n in (cfg.vocab_size, cfg.max_positions, cfg.type_vocab_size))
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, ids: torch.Tensor, token_types: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.token_type(token_types) + self.position(positions)
        x = self.embed_norm(x)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype) -> BertEncoder:
        """Each weight is read from the (memory-mapped) safetensors file straight into `dtype`,
        so the file's float32 copy never becomes resident as a whole."""
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no safetensors weights in {folder}")
        cfg = BertConfig.from_hf(json.loads((folder / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    state[name] = weights.get_tensor(name).to(dtype)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(_our_names(state, cfg.num_layers), assign=True)
        return model.eval().requires_grad_(False)


def _our_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face BertModel weight names -> ours (query, key and value stacked into one)."""
    state = {k.removeprefix("bert."): v for k, v in state.items()}
    try:
        out = {"word.weight": state["embeddings.word_embeddings.weight"],
               "position.weight": state["embeddings.position_embeddings.weight"],
               "token_type.weight": state["embeddings.token_type_embeddings.weight"],
               "embed_norm.weight": state["embeddings.LayerNorm.weight"],
               "embed_norm.bias": state["embeddings.LayerNorm.bias"]}
        for n in range(num_layers):
            hf, ours = f"encoder.layer.{n}.", f"layers.{n}."
            for kind in ("weight", "bias"):
                out[ours + "qkv." + kind] = torch.cat(
                    [state[f"{hf}attention.self.{p}.{kind}"] for p in ("query", "key", "value")])
                out[ours + "attn_out." + kind] = state[f"{hf}attention.output.dense.{kind}"]
                out[ours + "attn_norm." + kind] = state[f"{hf}attention.output.LayerNorm.{kind}"]
                out[ours + "up." + kind] = state[f"{hf}intermediate.dense.{kind}"]
                out[ours + "down." + kind] = state[f"{hf}output.dense.{kind}"]
                out[ours + "out_norm." + kind] = state[f"{hf}output.LayerNorm.{kind}"]
    except KeyError as exc:
        raise ModelLoadError(f"weight missing from the BERT checkpoint: {exc.args[0]}") from None
    return out
