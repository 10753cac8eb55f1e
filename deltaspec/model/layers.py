"""Shared building blocks: zero-centred RMSNorm, SwiGLU MLP, and the mixture-of-experts MLP."""

import torch
import torch.nn.functional as F
from torch import nn

from deltaspec.config import ModelConfig, MoEConfig
from deltaspec.ops.dispatch import OpTable


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + weight)`."""

    def __init__(self, dim: int, eps: float, ops: OpTable):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts, stored fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, moe: MoEConfig, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.moe_intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.moe_intermediate_size))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_idx, top_weight [N, k] -> [N, H]."""
        out = torch.zeros_like(x)
        for expert in top_idx.unique().tolist():
            rows, which = torch.where(top_idx == expert)
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * top_weight[rows, which, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Softmax router (fp32), top-k experts (renormalised), plus a sigmoid-gated shared expert."""

    def __init__(self, moe: MoEConfig, hidden: int):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe, hidden)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        top_weight, top_idx = torch.topk(probs, self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_idx, top_weight.to(x.dtype))
        if self.moe.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def make_mlp(config: ModelConfig, use_moe: bool) -> nn.Module:
    if use_moe and config.moe is not None:
        return SparseMoE(config.moe, config.hidden_size)
    return MLP(config.hidden_size, config.intermediate_size)
