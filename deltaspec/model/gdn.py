"""Gated DeltaNet mixer (DESIGN §1): projections, causal conv, gated delta rule, gated norm.

Two projection layouts load into the same module: Qwen3.5 keeps `in_proj_qkv` ([all Q | all K |
all V]), `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next keeps `in_proj_qkvz` and `in_proj_ba`
grouped per key head, which `_split_grouped` reorders into the same q, k, v, z, b, a.
"""

import torch
import torch.nn.functional as F
from torch import nn

from deltaspec.config import ModelConfig
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.norms import compute_dtype, l2_norm


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, state_index: int, ops: OpTable):
        super().__init__()
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.layout = config.gdn_layout
        self.state_index = state_index
        self.eps = config.rms_norm_eps
        self.ops = ops
        hidden, key_dim, value_dim = config.hidden_size, self.hk * self.dk, self.hv * self.dv
        if self.layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, 2 * key_dim + value_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(config.gdn_conv_dim, config.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm_weight = nn.Parameter(torch.empty(self.dv))
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)

    def _split_grouped(self, x: torch.Tensor):
        """Qwen3-Next: per key head [Dk q, Dk k, r*Dv v, r*Dv z] and [r b, r a] -> flat qkv, z, b, a."""
        t, r = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, -1)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's state slots in place."""
        t = x.shape[0]
        if self.layout == "qwen3_next":
            qkv, z, b, a = self._split_grouped(x)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.hv, self.dv)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        layer = self.state_index
        conv_state, state = caches.gdn.conv[layer], caches.gdn.state[layer]
        qkv = self.ops.causal_conv1d(qkv, self.conv1d_weight, conv_state, batch.query_lens, batch.state_slot_list,
                                     batch.fold, batch.speculative, caches.gdn.conv_log[layer])
        q, k, v = torch.split(qkv, [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        acc = compute_dtype(x.dtype)
        q = l2_norm(q.reshape(t, self.hk, self.dk).to(acc)) * self.dk ** -0.5  # [T, Hk, Dk]
        k = l2_norm(k.reshape(t, self.hk, self.dk).to(acc))
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.to(acc).exp() * F.softplus(a.to(acc) + self.dt_bias)  # [T, Hv], log-space decay
        o = self.ops.gated_delta_rule(q, k, v.reshape(t, self.hv, self.dv), g, beta, state, batch.query_lens,
                                      batch.state_slot_list, batch.fold, batch.speculative, caches.gdn.log[layer])
        o = self.ops.gated_rms_norm(o.to(x.dtype), z, self.norm_weight, self.eps)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(t, self.hv * self.dv))
