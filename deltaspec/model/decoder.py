"""One decoder block (`h += mixer(norm1(h)); h += mlp(norm2(h))`) and the caches it reads."""

from dataclasses import dataclass

import torch
from torch import nn

from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.state_cache import GDNStateCache
from deltaspec.config import ModelConfig
from deltaspec.model.attention import GatedAttention
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.gdn import GatedDeltaNet
from deltaspec.model.layers import RMSNorm
from deltaspec.ops.dispatch import OpTable


@dataclass
class ModelCaches:
    """The caches one model reads and writes: attention pages and GDN state slots."""

    kv: PagedKVCache
    gdn: GDNStateCache


class DecoderLayer(nn.Module):
    """`h += mixer(norm1(h)); h += mlp(norm2(h))`."""

    def __init__(self, config: ModelConfig, mixer_index: int, ops: OpTable, is_gdn: bool,
                 mlp: nn.Module):
        super().__init__()
        self.is_gdn = is_gdn
        if is_gdn:
            self.linear_attn = GatedDeltaNet(config, mixer_index, ops)
        else:
            self.self_attn = GatedAttention(config, mixer_index, ops)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, cos, sin) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_gdn:
            h = h + self.linear_attn(x, batch, caches)
        else:
            h = h + self.self_attn(x, batch, caches, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))
