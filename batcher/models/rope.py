"""Rotary position embeddings: inverse frequencies and the cos/sin scaling of every RoPE variant the
supported configs use, in one place.

A config's rope parameters are the dict Hugging Face keeps as `rope_parameters` (transformers 5)
or `rope_scaling` (4.x): `rope_type` (or the older `type`) is one of default, linear, dynamic,
llama3, yarn or longrope, with that variant's fields. `rope_tables` turns them into the cos/sin
table of every position up to the context length, which is all the model reads per step.

- linear: positions interpolated by `factor` (every frequency divided by it).
- dynamic (NTK): the base grows only past `max_position_embeddings`; the context is capped at
  that length here, so within it the frequencies are the default ones (as in transformers).
- llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
- yarn: interpolation and extrapolation blended over a ramp of dimensions, cos/sin scaled by
  `attention_factor` (from `mscale`/`mscale_all_dim` when not given).
- longrope (Phi-3 "su"): per-dimension `short_factor` for positions below
  `original_max_position_embeddings` and `long_factor` from there on, cos/sin scaled by
  `attention_factor` (sqrt(1 + ln(factor) / ln(original length)) when not given).
  NOTE: transformers switches a whole sequence to the long factors once it grows past the
  original length; a paged cache keeps the K it wrote, so here the factor follows each position.
- freq_factors: every frequency divided by its own factor, as a GGUF file's `rope_freqs` tensor
  gives them (llama.cpp writes Llama 3.1's scaling so).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")


def rope_type(params: dict[str, Any] | None) -> str:
    params = params or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    return "longrope" if kind == "su" else kind  # Phi-3's first configs called it "su"


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # [dim / 2], in float64: the table is built once and rounded to the model's dtype after.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def inv_freq(params: dict[str, Any] | None, theta: float, dim: int, max_positions: int,
             long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], cos/sin scale) for one set of rope parameters. `long`:
    longrope's long factors (past the original context) instead of its short ones."""
    params = params or {}
    kind = rope_type(params)
    base = _base_inv_freq(theta, dim)
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "linear":
        return base / params["factor"], 1.0
    if kind == "llama3":
        factor = params["factor"]
        low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / base
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if kind == "yarn":
        return _yarn(params, theta, dim, max_positions)
    if kind == "freq_factors":
        factors = torch.tensor(params["factors"], dtype=torch.float64)
        if factors.shape != base.shape:
            raise ValueError(f"rope_freqs: {factors.shape[0]} factors, {base.shape[0]} needed")
        return base / factors, 1.0
    if kind == "longrope":
        old_len = params.get("original_max_position_embeddings") or max_positions
        factor = params.get("factor") or max_positions / old_len
        scale = params.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float64)
        if ext.shape != base.shape:
            raise ValueError(f"longrope factors: {ext.shape[0]} given, {base.shape[0]} needed")
        return base / ext, float(scale)
    raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], theta: float, dim: int, max_positions: int
          ) -> tuple[torch.Tensor, float]:
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / old_len
    scale = params.get("attention_factor")
    if scale is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                 else _yarn_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns over the original context.
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # share of each dimension left at its original frequency
    base = _base_inv_freq(theta, dim)
    return base / factor * (1 - extrapolate) + base * extrapolate, float(scale)


def rope_tables(params: dict[str, Any] | None, theta: float, dim: int, max_len: int,
                max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, dim / 2] in float64, scaled, for positions 0..max_len-1."""
    t = torch.arange(max_len, dtype=torch.float64)
    freqs_inv, scale = inv_freq(params, theta, dim, max_positions)
    freqs = torch.outer(t, freqs_inv)
    if rope_type(params) == "longrope":
        old_len = (params or {}).get("original_max_position_embeddings") or max_positions
        long_inv, _ = inv_freq(params, theta, dim, max_positions, long=True)
        past = t >= old_len
        freqs[past] = torch.outer(t[past], long_inv)
    return freqs.cos() * scale, freqs.sin() * scale
