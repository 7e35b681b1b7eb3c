"""Read a GGUF file of a supported architecture (`gguf_arch`) into a config and tensors in Hugging
Face names: dense (dequantized), or Q4_1 matrices kept in their blocks for the int4 kernels."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batcher.models import gguf_arch
from batcher.models.errors import ModelLoadError
from batcher.models.gguf_file import GGUFFile
from batcher.models.llama import LlamaConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Sparse layers: the router, the stacked experts (joined below), Qwen2-MoE's shared expert.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Mixtral's older files: one tensor per expert, `blk.N.ffn_gate.E.weight`.
_EXPERT_NAMES = {"ffn_gate": "w1", "ffn_down": "w2", "ffn_up": "w3"}
Q4_1_GROUP = 32  # weights per Q4_1 block
_ROWS_PER_SLICE = 4096  # rows dequantized at a time
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF stores Q and K rows interleaved per head for its rotary layout; undo it so the
    rotate-half RoPE of the reference applies. w: [n_heads * head_dim, hidden]."""
    out_dim = w.shape[0]
    return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@dataclass(slots=True)
class Q4_1Blocks:
    """One Q4_1 weight as stored in the file, not yet decoded: rows of 20-byte blocks, each a
    float16 scale d, a float16 minimum m and 32 4-bit values q (low nibbles are the block's first
    16, high nibbles its last 16), so w = q * d + m. raw: uint8 [N, K / 32 * 20], a view into the
    file. `rotary_heads` set: the rows are in GGUF's rotary order and are put back on unpacking."""

    raw: np.ndarray
    rotary_heads: int | None = None

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (q int32 in [0, 15] [N, K], scale fp32 [N, K / 32], minimum fp32 [N, K / 32])."""
        n = self.raw.shape[0]
        blocks = torch.from_numpy(np.array(self.raw)).reshape(n, -1, 20)  # own copy
        scale = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        lo = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        packed = blocks[..., 4:]
        q = torch.empty((n, packed.shape[1], Q4_1_GROUP), dtype=torch.int32)
        q[..., :16] = packed & 15
        q[..., 16:] = packed >> 4
        q = q.reshape(n, -1)
        if self.rotary_heads is not None:
            q, scale, lo = (unpermute_rotary(t, self.rotary_heads) for t in (q, scale, lo))
        return q, scale, lo

    def dense(self) -> torch.Tensor:
        """The weight as fp32 [N, K]."""
        q, scale, lo = self.unpack()
        n, k = q.shape
        return (q.reshape(n, -1, Q4_1_GROUP).float() * scale[..., None]
                + lo[..., None]).reshape(n, k)


@dataclass(slots=True)
class GGUFRows:
    """A matrix left in the file (any GGUF type), dequantized a slice of rows at a time on
    request, so that its dense form never exists whole."""

    data: np.ndarray  # as the file holds it: rows first
    kind: object  # GGMLQuantizationType

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @property
    def width(self) -> int:
        return int(_dequantize(self.data[:1], self.kind, torch.float32).shape[-1])

    def rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) in `dtype`; then the whole file mapping's pages leave the resident
        set (`drop_file_pages`: the weights read before these were already copied out)."""
        out = _dequantize(self.data[start:stop], self.kind, dtype)
        drop_file_pages(self.data)
        return out


def drop_file_pages(data: np.ndarray) -> None:
    """Let the pages of the file mapping behind `data` (any tensor of a `GGUFFile`) leave this
    process's resident set. They stay in the page cache; reading them again maps them again.
    A load that copies every weight out of the file would otherwise hold the whole file
    resident on top of its copies until the mapping closes."""
    # NOTE: safe because `GGUFFile` maps the file read-only and shared: no page holds anything
    # the file does not. On a writable private mapping this would throw writes away.
    mm = getattr(data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is not None and advice is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(advice)
        except OSError:  # a locked mapping (mlockall): the pages stay, nothing else changes
            pass


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and every tensor dequantized to fp32, in Hugging Face names."""
    cfg, dense, _ = read_gguf_q4(path, keep_q4_1=False)
    return cfg, dense


def mostly_q4_1(path: Path) -> bool:
    """Whether most of the file's decoder-layer matrices are Q4_1 blocks (read from its header
    only): the files `--quantization int4` runs as stored. False for a file it cannot read."""
    from gguf import GGMLQuantizationType

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError):
        return False
    kinds = [t.tensor_type for t in reader.tensors
             if t.name.startswith("blk.") and len(t.data.shape) == 2]
    return bool(kinds) and 2 * kinds.count(GGMLQuantizationType.Q4_1) > len(kinds)


def read_gguf_config(path: Path) -> LlamaConfig:
    """The model's config alone, from the file's header (no tensor is read)."""
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path.name}: {exc}") from exc
    return _config(reader)


def read_gguf_q4(path: Path, keep_q4_1: bool = True, dtype: torch.dtype = torch.float32,
                 lazy: frozenset[str] = frozenset(),
                 ) -> tuple[LlamaConfig, dict[str, torch.Tensor | GGUFRows],
                            dict[str, Q4_1Blocks]]:
    """The config, the tensors dequantized to `dtype` and, with `keep_q4_1`, the Q4_1 matrices
    left in their blocks (their bytes stay in the file's mapping until unpacked), both in
    Hugging Face names. Matrices named in `lazy` come as `GGUFRows`, whatever their type."""
    from gguf import GGMLQuantizationType

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path.name}: {exc}") from exc
    cfg = _config(reader)
    arch = reader.fields.get("general.architecture")
    names = _LAYER_NAMES | gguf_arch.layer_names(arch)
    permuted = arch in gguf_arch.ROTARY_PERMUTED
    dense: dict[str, torch.Tensor] = {}
    q4: dict[str, Q4_1Blocks] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES:
            hf = (f"model.layers.{parts[1]}.block_sparse_moe.experts.{parts[3]}."
                  f"{_EXPERT_NAMES[parts[2]]}.{kind}")
        elif parts[0] == "blk" and parts[2] in names:
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
        elif base in _TOP_NAMES:
            hf = f"{_TOP_NAMES[base]}.{kind}"
        else:
            continue
        heads = None
        if permuted and parts[-1] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if parts[-1] == "attn_q" else cfg.num_kv_heads
        if hf in lazy and heads is None and len(t.data.shape) == 2:
            dense[hf] = GGUFRows(t.data, t.tensor_type)
            continue
        if (keep_q4_1 and t.tensor_type == GGMLQuantizationType.Q4_1
                and len(t.data.shape) == 2):
            q4[hf] = Q4_1Blocks(t.data, heads)
            continue
        w = _dequantize(t.data, t.tensor_type, dtype)
        dense[hf] = w if heads is None else unpermute_rotary(w, heads)
    for n in cfg.moe_layers:  # each expert's gate rows, then its up rows
        p = f"model.layers.{n}.mlp.experts."
        if p + "gate_exps.weight" in dense:
            dense[p + "gate_up_proj"] = torch.cat(
                [dense.pop(p + "gate_exps.weight"), dense.pop(p + "up_exps.weight")], dim=1)
            dense[p + "down_proj"] = dense.pop(p + "down_proj.weight")
    return cfg, dense, q4


def _dequantize(data: np.ndarray, kind, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in `dtype`, dequantized a slice of rows at a time so that the fp32 intermediates
    of a large table (the embeddings) never exist whole."""
    from gguf.quants import dequantize

    first = dequantize(data[:_ROWS_PER_SLICE], kind)
    if data.ndim < 2 or data.shape[0] <= _ROWS_PER_SLICE:
        return torch.from_numpy(np.array(first, dtype=np.float32)).to(dtype)  # own copy
    out = torch.empty((data.shape[0], *first.shape[1:]), dtype=dtype)
    out[:_ROWS_PER_SLICE] = torch.from_numpy(np.asarray(first, dtype=np.float32))
    for start in range(_ROWS_PER_SLICE, data.shape[0], _ROWS_PER_SLICE):
        part = dequantize(data[start:start + _ROWS_PER_SLICE], kind)
        out[start:start + part.shape[0]] = torch.from_numpy(np.asarray(part, dtype=np.float32))
    return out


def _config(reader: GGUFFile) -> LlamaConfig:
    return gguf_arch.config(reader)
