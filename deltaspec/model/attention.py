"""Gated full attention (DESIGN §1): q/gate split, q/k norms, partial RoPE, GQA over paged KV,
output gated by sigmoid(gate). The q, k and v projections are fused into `qkv_proj` once loaded."""

import torch
from torch import nn

from deltaspec.config.model import ModelConfig
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.layers import Linear, RMSNorm, fuse
from deltaspec.ops.dispatch import OpTable


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_index: int, ops: OpTable):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.kv_index = kv_index
        self.ops = ops
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.heads * self.head_dim * 2, ops, bias=bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, ops, bias=bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, ops, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, ops, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def fuse(self) -> None:
        fuse(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"], self.ops)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, caches, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's K/V rows into the paged cache."""
        t = x.shape[0]
        q_gate, k, v = self.qkv_proj(x)
        q, gate = q_gate.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, Hq, D] each
        q = self.ops.norm_rope(q, self.q_norm.weight, cos, sin, self.q_norm.eps)
        k = self.ops.norm_rope(k.view(t, self.kv_heads, self.head_dim), self.k_norm.weight, cos, sin, self.k_norm.eps)
        v = v.view(t, self.kv_heads, self.head_dim)
        k_cache, v_cache = caches.kv.k[self.kv_index], caches.kv.v[self.kv_index]
        self.ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        o = self.ops.paged_attention(q.contiguous(), k_cache, v_cache, batch.layout, self.head_dim**-0.5)
        return self.o_proj(o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))
