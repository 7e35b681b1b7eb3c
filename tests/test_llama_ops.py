"""The model's per-layer small ops (RoPE over Q and K in one call from signed tables, RMSNorm)
compute exactly what transformers' Llama computes, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from batcher.models.llama import RMSNorm, RotaryTables, apply_rope, rope_inv_freq
from batcher.models.tiny import tiny_config

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_fused_qk_equals_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = tiny_config()
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    torch.manual_seed(0)
    t = 7
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 100, 5])
    cos, sin = RotaryTables(cfg, 128, torch.device("cpu"), dtype).lookup(positions)
    # As the attention layer does: Q and K heads side by side, one call, then split.
    qk = apply_rope(qkv[:, :(heads + kv_heads) * hd].view(t, -1, hd), cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)

    freqs = positions[:, None].double() * rope_inv_freq(cfg)
    emb = torch.cat((freqs, freqs), -1)
    q_ref, k_ref = apply_rotary_pos_emb(
        qkv[:, :heads * hd].view(t, heads, hd),
        qkv[:, heads * hd:(heads + kv_heads) * hd].view(t, kv_heads, hd),
        emb.cos().to(dtype), emb.sin().to(dtype))
    assert torch.equal(q, q_ref)
    assert torch.equal(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(1)
    ours, ref = RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(5, 64) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
