"""Every RoPE variant's frequencies and cos/sin scale equal transformers' own (its
`ROPE_INIT_FUNCTIONS`, read from a config that carries the parameters)."""

from __future__ import annotations

import pytest
import torch

from batcher.models import rope

HEAD_DIM, THETA, MAX_POS = 64, 500000.0, 8192
CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 2048,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + 0.25 * i for i in range(HEAD_DIM // 2)]},
}


def _hf(params: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=MAX_POS,
                      rope_parameters=dict(params, rope_theta=THETA))
    kind = params["rope_type"]
    if kind == "default":
        base = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        return base, 1.0
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_scale_equal_transformers(case: str) -> None:
    params = CASES[case]
    want, want_scale = _hf(params)
    got, scale = rope.inv_freq(params, THETA, HEAD_DIM, MAX_POS)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=0)
    assert scale == pytest.approx(float(want_scale), rel=1e-6)
    if case == "longrope":  # past the original length: the long factors
        want_long, _ = _hf(params, seq_len=4096)
        got_long, _ = rope.inv_freq(params, THETA, HEAD_DIM, MAX_POS, long=True)
        torch.testing.assert_close(got_long.float(), want_long.float(), rtol=1e-5, atol=0)
        assert not torch.allclose(got_long, got)
        cos, _ = rope.rope_tables(params, THETA, HEAD_DIM, 4096, MAX_POS)
        # Positions below 2048 turn by the short factors, from there on by the long ones.
        assert torch.allclose(cos[2047], (2047 * got).cos() * scale)
        assert torch.allclose(cos[2048], (2048 * got_long).cos() * scale)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope type 'mrope'"):
        rope.inv_freq({"rope_type": "mrope"}, THETA, HEAD_DIM, MAX_POS)
