"""Build an int4 model straight from a GGUF file's Q4_1 blocks.

Q4_1 stores each group of 32 weights as a scale, a minimum and 4-bit values: the same function as
the CPU int4 kernel's groups of 32 (scale and zero point), so a block is re-laid out, never
dequantized. No dense copy of the decoder layers exists at any point unless the layers keep one
for large steps, which keeps both the peak and the resident memory of an int4 load low. A tied
embedding table and LM head become one per-row int8 table too, with a dense copy of its values
for steps past a few rows (HEAD_DENSE_ABOVE_ROWS, or the layers' own row count where smaller)
whether or not the layers keep theirs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from batcher.models import gguf_weights
from batcher.models.errors import ModelLoadError
from batcher.models.gguf_weights import Q4_1Blocks
from batcher.models.llama import LlamaConfig, LlamaModel
from batcher.runtime.quant import (
    HEAD_DENSE_ABOVE_ROWS,
    PackedLinear,
    int8_rows_of,
    tie_int8_table,
)

# Our fused linears and the Hugging Face weights they stack by rows, in order.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


def load_int4_gguf(path: Path, dtype: torch.dtype, dense_above: int | None,
                   ) -> tuple[LlamaConfig, LlamaModel, int]:
    """-> (config, model on the CPU, how many linears came from Q4_1 blocks). A fused linear
    whose parts are not all Q4_1 is dequantized and quantized to int4 like any dense weight."""
    table_name = "model.embed_tokens.weight"
    cfg, dense, q4 = gguf_weights.read_gguf_q4(path, dtype=dtype, lazy=frozenset({table_name}))
    with torch.device("meta"):
        model = LlamaModel(cfg)
    direct = 0
    for n, layer in enumerate(model.layers):
        for ours, parts in _FUSED.items():
            names = [f"model.layers.{n}.{p}.weight" for p in parts]
            biases = [dense.pop(f"model.layers.{n}.{p}.bias", None) for p in parts]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            if all(name in q4 for name in names):
                blocks = [q4.pop(name) for name in names]
                packed = PackedLinear.from_int4(*_stack(blocks), dtype, dense_above, bias)
                gguf_weights.drop_file_pages(blocks[0].raw)  # repacked: the file's copy can go
                direct += 1
            else:
                if any(name not in q4 and name not in dense for name in names):
                    raise ModelLoadError(f"weights missing from the checkpoint: {names}")
                w = torch.cat([q4.pop(name).dense() if name in q4 else dense.pop(name)
                               for name in names])
                lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
                lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
                packed = PackedLinear(lin, "int4", dense_above)
            parent_name, _, attr = ours.rpartition(".")
            setattr(layer.get_submodule(parent_name), attr, packed)
    # A tied table is read from the file a slice of rows at a time straight into int8: its
    # dense form (56 MiB in bf16 on the bundled model) was the largest piece of the load's peak.
    table = dense.pop(table_name, None)
    if table is not None and not cfg.tie_word_embeddings:  # an untied table stays dense
        dense[table_name], table = table.rows(0, table.num_rows, dtype), None
    if table is not None and (table.num_rows, table.width) != (cfg.vocab_size, cfg.hidden_size):
        raise ModelLoadError(f"token_embd is {table.num_rows} x {table.width}, the config says "
                             f"{cfg.vocab_size} x {cfg.hidden_size}")
    # What is left (embeddings, norms, an untied LM head) is small or must stay dense.
    rest = {k.removeprefix("model."): v for k, v in dense.items()}
    rest |= {k.removeprefix("model."): v.dense() for k, v in q4.items()}
    del dense, q4  # the last views into the file's mapping
    if cfg.tie_word_embeddings:
        rest.pop("lm_head.weight", None)
    missing = {k for k, t in model.state_dict().items() if t.is_meta} - set(rest)
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if table is not None:
        missing.discard("embed_tokens.weight")  # the tied table, below
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in rest.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        # The tied table as int8 as well. The head keeps a dense copy for steps past a few rows,
        # where the dense matmul is faster, even where the layers keep none: the packed int8
        # kernel's time grows with every row (see HEAD_DENSE_ABOVE_ROWS), 56 MiB buys back
        # a tenth to a fifth of a 16- to 32-row decode step.
        head_dense_above = (HEAD_DENSE_ABOVE_ROWS if dense_above is None
                            else min(dense_above, HEAD_DENSE_ABOVE_ROWS))
        q, scale = int8_rows_of(table.rows, table.num_rows, cfg.hidden_size)
        del table  # its view into the file's mapping
        tie_int8_table(model, q, scale, dtype, head_dense_above)
    return cfg, model.eval().requires_grad_(False), direct


def _stack(parts: list[Q4_1Blocks]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack Q4_1 matrices by rows: groups run along the input dimension, so rows stack as is."""
    unpacked = [p.unpack() for p in parts]
    if len(unpacked) == 1:
        return unpacked[0]
    return tuple(torch.cat(xs) for xs in zip(*unpacked, strict=True))  # type: ignore[return-value]
