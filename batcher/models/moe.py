"""One sparse mixture-of-experts MLP for Mixtral, Qwen2-MoE and Qwen3-MoE.

A linear router scores every expert per token; softmax over all experts, keep the top k, and
(Mixtral, Qwen3-MoE; a config switch) renormalise the kept weights to sum to one. The token-expert
pairs are then sorted by expert, so each expert's rows are one contiguous slice and its MLP is
one matmul over them: the Python loop runs over experts that got tokens, never over tokens.
Qwen2-MoE adds a shared expert, a dense MLP every token takes, gated per token by a sigmoid.

Weights: `gate` [experts, hidden] (the router), `experts_gate_up` [experts, 2 * inter, hidden]
(each expert's gate rows then up rows) and `experts_down` [experts, hidden, inter].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from batcher.models.llama import LlamaConfig


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.inter, self.renormalize = cfg.experts_per_tok, inter, cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, inter))
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_size:
            self.shared_expert = SharedExpert(h, cfg.shared_expert_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        t, k = x.shape[0], self.top_k
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, experts]
        weights, experts = probs.topk(k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()  # [T * k]: pair p is token p // k
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts_down.shape[0]).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)  # [T * k, hidden], grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            gate, up = (xs[start:start + n] @ self.experts_gate_up[e].T).split(self.inter, -1)
            ys[start:start + n] = (F.silu(gate) * up) @ self.experts_down[e].T
            start += n
        ys = ys * weights.flatten()[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x).index_add_(0, token_of, ys)  # [T, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
