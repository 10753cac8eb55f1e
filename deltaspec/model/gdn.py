"""Gated DeltaNet mixer (DESIGN §1): projections, causal conv, gated delta rule, gated norm.

Two projection layouts load into the same module: Qwen3.5 keeps `in_proj_qkv` ([all Q | all K |
all V]), `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next keeps `in_proj_qkvz` and `in_proj_ba`
grouped per key head, which `_split_grouped` reorders into the same q, k, v, z, b, a. Either way
the input projections are fused into one `in_proj` weight after loading.
"""

import torch
from torch import nn

from deltaspec.config.model import ModelConfig
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.layers import Linear, fuse
from deltaspec.ops.dispatch import OpTable


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
            self.in_proj_qkvz = Linear(hidden, 2 * key_dim + 2 * value_dim, ops)
            self.in_proj_ba = Linear(hidden, 2 * self.hv, ops)
        else:
            self.in_proj_qkv = Linear(hidden, 2 * key_dim + value_dim, ops)
            self.in_proj_z = Linear(hidden, value_dim, ops)
            self.in_proj_b = Linear(hidden, self.hv, ops)
            self.in_proj_a = Linear(hidden, self.hv, ops)
        self.conv1d_weight = nn.Parameter(torch.empty(config.gdn_conv_dim, config.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm_weight = nn.Parameter(torch.empty(self.dv))
        self.out_proj = Linear(value_dim, hidden, ops)

    def fuse(self) -> None:
        parts = (
            ["in_proj_qkvz", "in_proj_ba"]
            if self.layout == "qwen3_next"
            else ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        )
        fuse(self, "in_proj", parts, self.ops)

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> qkv [T, conv channels], z [T, Hv, Dv], b, a [T, Hv]. Qwen3-Next groups its
        projections per key head ([Dk q, Dk k, r*Dv v, r*Dv z] and [r b, r a]); they are reordered."""
        t = x.shape[0]
        if self.layout != "qwen3_next":
            qkv, z, b, a = self.in_proj(x)
            return qkv, z.view(t, self.hv, self.dv), b, a
        r = self.hv // self.hk
        qkvz, ba = self.in_proj(x)
        q, k, v, z = torch.split(qkvz.view(t, self.hk, -1), [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(ba.view(t, self.hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's state slots in place."""
        t = x.shape[0]
        qkv, z, b, a = self._project(x)
        layer = self.state_index
        qkv = self.ops.causal_conv1d(
            qkv.contiguous(), self.conv1d_weight, caches.gdn.conv[layer], batch.layout, caches.gdn.conv_log[layer]
        )  # [T, conv channels]
        q, k, v = torch.split(qkv, [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k, g, beta = self.ops.gdn_gates(
            q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk), a, b, self.A_log, self.dt_bias
        )
        o = self.ops.gated_delta_rule(
            q, k, v.view(t, self.hv, self.dv), g, beta, caches.gdn.state[layer], batch.layout, caches.gdn.log[layer]
        )  # [T, Hv, Dv]
        o = self.ops.gated_rms_norm(o, z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(t, self.hv * self.dv))
