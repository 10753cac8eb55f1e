"""CacheManager: hands KV pages and GDN state slots to sequences and takes them back, moves each
sequence's replay-log cursor (`deltaspec.cache.replay`), and keeps the prefix checkpoints
(`deltaspec.cache.prefix_cache`) that let a new sequence resume where an earlier one left a checkpoint."""

import math

import torch

from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.model_caches import ModelCaches
from deltaspec.cache.prefix_cache import PrefixCache
from deltaspec.cache.state_cache import GDNStateCache
from deltaspec.config.model import ModelConfig


class CacheManager:
    def __init__(
        self,
        config: ModelConfig,
        num_kv_layers: int,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device,
        log_rows: int = 0,
        checkpoint_slots: int = 0,
        offload_bytes: int = 0,
        kv_dtype: torch.dtype | None = None,
    ):
        self.block_size = block_size
        self.num_slots = num_slots
        self.model_kv_layers = len(config.attention_layer_ids)  # the model's own, before a drafter's MTP layers
        self.kv = PagedKVCache(
            num_kv_layers,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            kv_dtype or dtype,
            device,
        )
        self.gdn = GDNStateCache(
            len(config.gdn_layer_ids),
            num_slots,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.gdn_conv_dim,
            config.linear_conv_kernel_dim,
            state_dtype,
            dtype,
            device,
            log_rows,
            checkpoint_slots,
        )
        self.caches = ModelCaches(kv=self.kv, gdn=self.gdn)
        self.prefix = PrefixCache(self.kv, self.gdn, offload_bytes) if checkpoint_slots else None

    def usage(self) -> dict:
        """KV pages and GDN state slots in use, and what prefix checkpoints hold (their pages count as cached, not
        used: eviction frees them)."""
        kv, prefix = self.kv.allocator, self.prefix
        cached = prefix.pages_held_only_here() if prefix is not None else 0
        return {
            "kv_blocks_used": kv.num_blocks - kv.num_free - cached,
            "kv_blocks_cached": cached,
            "kv_blocks_total": kv.num_blocks,
            "prefix_checkpoints": len(prefix.checkpoints) if prefix is not None else 0,
            "prefix_hits": prefix.hits if prefix is not None else 0,
            "state_slots_used": self.num_slots - self.gdn.num_free,
            "state_slots_total": self.num_slots,
        }

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_admit(self) -> bool:
        return self.gdn.num_free > 0

    def admit(self, seq) -> None:
        """Give `seq` a state slot; with prefix caching, resume it from the deepest checkpoint its tokens
        continue (a request that wants prompt logprobs computes every prompt token)."""
        seq.state_slot = self.gdn.allocate()
        seq.replay.reset()
        seq.num_cached_tokens = 0
        if self.prefix is None or seq.num_computed or seq.params.prompt_logprobs is not None:
            return
        checkpoint = self.prefix.lookup(seq.all_ids)
        blocks = self.prefix.resume(checkpoint, seq.state_slot) if checkpoint is not None else None
        if blocks is not None:
            seq.blocks = blocks
            seq.num_computed = seq.num_cached_tokens = len(checkpoint.tokens)

    def checkpoint(self, seq, evict: bool = True) -> None:
        """Keep the state of `seq` for reuse, labelled with the tokens it has consumed (into a free checkpoint slot
        only, unless `evict`)."""
        length = seq.num_computed - seq.replay.unfolded
        if self.prefix is not None and length > 0:
            self.prefix.save(seq.all_ids[:length], seq.state_slot, seq.blocks, evict)

    @staticmethod
    def after_pass(seq, rows: int, logged: bool) -> None:
        """A pass ran `rows` rows of `seq` (into its replay log when `logged`): it has computed them."""
        seq.num_computed += rows
        seq.replay.after_pass(rows, logged, verifying=bool(seq.draft))

    def keep_verified(self, seq, kept: int | list[int]) -> None:
        """Of the rows the last pass logged for `seq`, the first `kept` stand, or the rows `kept` (the accepted path
        of a tree: ascending, from row 0); the rest never happened. A path's attention KV moves down to the
        positions its tokens now have (row r_d of the path to position first + d), in the model's layers (an MTP
        head writes its own rows when it catches up)."""
        first = seq.num_computed - seq.replay.logged  # the position of the pass's first row
        seq.num_computed -= seq.replay.keep(kept)
        moves = [(row, depth) for depth, row in enumerate([] if isinstance(kept, int) else kept) if row != depth]
        if moves:
            sources = seq.kv_slots([first + row for row, _ in moves], self.block_size)
            targets = seq.kv_slots([first + depth for _, depth in moves], self.block_size)
            self.kv.move_rows(sources, targets, self.model_kv_layers)

    def fits_without_eviction(self, seq, num_tokens: int) -> bool:
        """Whether `seq`'s pages can cover `num_tokens` tokens from free pages alone."""
        return self.blocks_needed(num_tokens) - len(seq.blocks) <= self.kv.allocator.num_free

    def reserve(self, seq, num_tokens: int) -> bool:
        """Make `seq`'s pages cover `num_tokens` tokens, evicting prefix checkpoints if pages run short;
        False (nothing taken) when they still do."""
        extra = self.blocks_needed(num_tokens) - len(seq.blocks)
        if extra <= 0:
            return True
        if extra > self.kv.allocator.num_free and self.prefix is not None:
            self.prefix.evict_for_pages(extra)
        if extra > self.kv.allocator.num_free:
            return False
        seq.blocks.extend(self.kv.allocator.allocate(extra))
        return True

    def release(self, seq) -> None:
        seq.replay.reset()
        if seq.state_slot is not None:
            self.gdn.free(seq.state_slot)
            seq.state_slot = None
        self.kv.allocator.free(seq.blocks)
        seq.blocks = []
