"""CacheManager: hands KV pages and GDN state slots to sequences and takes them back."""

import math

import torch

from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.state_cache import GDNStateCache
from deltaspec.config import ModelConfig
from deltaspec.model.decoder import ModelCaches


class CacheManager:
    def __init__(self, config: ModelConfig, num_kv_layers: int, num_slots: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, log_rows: int = 0):
        self.block_size = block_size
        self.kv = PagedKVCache(num_kv_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim,
                               dtype, device)
        self.gdn = GDNStateCache(len(config.gdn_layer_ids), num_slots, config.linear_num_key_heads,
                                 config.linear_num_value_heads, config.linear_key_head_dim,
                                 config.linear_value_head_dim, config.gdn_conv_dim, config.linear_conv_kernel_dim,
                                 state_dtype, dtype, device, log_rows)
        self.caches = ModelCaches(kv=self.kv, gdn=self.gdn)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_admit(self) -> bool:
        return self.gdn.num_free > 0

    def admit(self, seq) -> None:
        seq.state_slot = self.gdn.allocate()

    def reserve(self, seq, num_tokens: int) -> bool:
        """Make `seq`'s pages cover `num_tokens` tokens; False (nothing taken) when pages run short."""
        extra = self.blocks_needed(num_tokens) - len(seq.blocks)
        if extra <= 0:
            return True
        if extra > self.kv.allocator.num_free:
            return False
        seq.blocks.extend(self.kv.allocator.allocate(extra))
        return True

    def release(self, seq) -> None:
        if seq.state_slot is not None:
            self.gdn.free(seq.state_slot)
            seq.state_slot = None
        self.kv.allocator.free(seq.blocks)
        seq.blocks = []
