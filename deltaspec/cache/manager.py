"""CacheManager: hands KV pages and GDN state slots to sequences (to their `CacheHandle`s,
`deltaspec.cache.handle`) and takes them back, moves each handle's replay-log cursor (`deltaspec.cache.replay`),
and keeps the prefix checkpoints (`deltaspec.cache.prefix_cache`) that let a new sequence resume where an earlier
one left a checkpoint."""

import math

from deltaspec.cache.handle import CacheHandle
from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.model_caches import ModelCaches
from deltaspec.cache.prefix_cache import PrefixCache
from deltaspec.cache.state_cache import GDNStateCache
from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.model import ModelConfig


class CacheManager:
    def __init__(self, config: ModelConfig, num_kv_layers: int, spec: CacheSpec):
        """Caches of `config` as `spec` sizes them: `num_kv_layers` attention layers of KV pages (the model's, then
        an MTP head's), a GDN state slot per stream and per prefix checkpoint, and the checkpoints' host offload."""
        self.block_size = spec.block_size
        self.num_slots = spec.streams
        self.model_kv_layers = len(config.attention_layer_ids)  # the model's own, before a drafter's MTP layers
        self.kv = PagedKVCache(num_kv_layers, config, spec)
        self.gdn = GDNStateCache(config, spec)
        self.caches = ModelCaches(kv=self.kv, gdn=self.gdn)
        self.prefix = PrefixCache(self.kv, self.gdn, spec.offload_bytes) if spec.checkpoint_slots else None

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

    def admit(self, handle: CacheHandle, tokens: list[int], resume: bool = True) -> None:
        """Give `handle` a state slot; with prefix caching and `resume`, a handle that has computed nothing resumes
        from the deepest checkpoint its `tokens` continue (a request that wants prompt logprobs computes every
        prompt token, so does not resume)."""
        handle.state_slot = self.gdn.allocate()
        handle.replay.reset()
        handle.num_cached_tokens = 0
        if self.prefix is None or handle.num_computed or not resume:
            return
        checkpoint = self.prefix.lookup(tokens)
        blocks = self.prefix.resume(checkpoint, handle.state_slot) if checkpoint is not None else None
        if blocks is not None:
            handle.blocks = blocks
            handle.num_computed = handle.num_cached_tokens = len(checkpoint.tokens)

    def checkpoint(self, handle: CacheHandle, tokens: list[int], evict: bool = True) -> None:
        """Keep the state of `handle` for reuse, labelled with the first of its `tokens` that it has consumed (into a
        free checkpoint slot only, unless `evict`)."""
        length = handle.num_computed - handle.replay.unfolded
        if self.prefix is not None and length > 0:
            self.prefix.save(tokens[:length], handle.state_slot, handle.blocks, evict)

    @staticmethod
    def after_pass(handle: CacheHandle, rows: int, logged: bool, verifying: bool) -> None:
        """A pass ran `rows` rows of `handle`'s sequence (into its replay log when `logged`; `verifying`: its rows
        included drafts): it has computed them."""
        handle.num_computed += rows
        handle.replay.after_pass(rows, logged, verifying)

    def keep_verified(self, handle: CacheHandle, kept: int | list[int]) -> None:
        """Of the rows the last pass logged for `handle`, the first `kept` stand, or the rows `kept` (the accepted
        path of a tree: ascending, from row 0); the rest never happened. A path's attention KV moves down to the
        positions its tokens now have (row r_d of the path to position first + d), in the model's layers (an MTP
        head writes its own rows when it catches up)."""
        first = handle.num_computed - handle.replay.logged  # the position of the pass's first row
        handle.num_computed -= handle.replay.keep(kept)
        moves = [(row, depth) for depth, row in enumerate([] if isinstance(kept, int) else kept) if row != depth]
        if moves:
            sources = handle.kv_slots([first + row for row, _ in moves], self.block_size)
            targets = handle.kv_slots([first + depth for _, depth in moves], self.block_size)
            self.kv.move_rows(sources, targets, self.model_kv_layers)

    def fits_without_eviction(self, handle: CacheHandle, num_tokens: int) -> bool:
        """Whether `handle`'s pages can cover `num_tokens` tokens from free pages alone."""
        return self.blocks_needed(num_tokens) - len(handle.blocks) <= self.kv.allocator.num_free

    def reserve(self, handle: CacheHandle, num_tokens: int) -> bool:
        """Make `handle`'s pages cover `num_tokens` tokens, evicting prefix checkpoints if pages run short;
        False (nothing taken) when they still do."""
        extra = self.blocks_needed(num_tokens) - len(handle.blocks)
        if extra <= 0:
            return True
        if extra > self.kv.allocator.num_free and self.prefix is not None:
            self.prefix.evict_for_pages(extra)
        if extra > self.kv.allocator.num_free:
            return False
        handle.blocks.extend(self.kv.allocator.allocate(extra))
        return True

    def release(self, handle: CacheHandle) -> None:
        handle.replay.reset()
        if handle.state_slot is not None:
            self.gdn.free(handle.state_slot)
            handle.state_slot = None
        self.kv.allocator.free(handle.blocks)
        handle.blocks = []
