"""Paged KV cache for the attention layers, and the allocator of its pages.

One pair of tensors per attention layer (the MTP head's layers included, the model's first), each
[num_blocks, block_size, Hkv, D] (views into one K and one V tensor of all layers, so a row moves in every layer at
once) (D + 16 for a quantized cache: each row's values and a tail with its float32 scale,
`deltaspec.ops.attention`); a sequence owns a list of pages (its block table) and token p
of the sequence lives at page `table[p // block_size]`, offset `p % block_size`.
"""

import torch

from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.ops.attention import kv_row_width


class BlockAllocator:
    """Free list of KV pages with reference counts: a page shared by several holders (sequences,
    prefix checkpoints) returns to the free list when the last one frees it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise DeltaspecError(
                f"The KV cache is out of pages ({count} needed, {len(self._free)} free); "
                "allocate more with --num-kv-blocks or run fewer sequences at once."
            )
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def refs(self, block: int) -> int:
        """How many holders `block` has (0: free)."""
        return self._refs[block]

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (all in use)."""
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; pages nobody holds go back to the free list."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)


class PagedKVCache:
    """K and V pages of every attention layer."""

    def __init__(self, num_layers: int, config: ModelConfig, spec: CacheSpec):
        """`num_layers` attention layers (the model's and an MTP head's) of `config`'s KV heads, with the pages and
        KV dtype of `spec`."""
        self.block_size = spec.block_size
        row = kv_row_width(config.head_dim, spec.kv_dtype)
        shape = (num_layers, spec.num_blocks, spec.block_size, config.num_key_value_heads, row)
        self.stacked = [torch.zeros(shape, dtype=spec.kv_dtype, device=spec.device) for _ in "kv"]  # K, V of all layers
        self.k, self.v = (list(stack.unbind(0)) for stack in self.stacked)  # per layer [blocks, bs, Hkv, D]
        self.allocator = BlockAllocator(spec.num_blocks)

    def byte_views(self) -> list[torch.Tensor]:
        """Every layer's K then V pages, a quantized cache's as uint8 views (CPU torch gathers no float8 by
        index)."""
        return [cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache for cache in (*self.k, *self.v)]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def move_rows(self, sources: list[int], targets: list[int], layers: int) -> None:
        """Copy the K and V rows at flat slots `sources` to slots `targets` in the first `layers` layers (every
        source is read before any target is written)."""
        index = torch.tensor([sources, targets], dtype=torch.long, device=self.stacked[0].device)
        for stack in self.stacked:
            rows = (stack.view(torch.uint8) if stack.dtype.itemsize == 1 else stack)[:layers].flatten(1, 2)
            rows.index_copy_(1, index[1], rows.index_select(1, index[0]))

    def copy_block(self, source: int, target: int) -> None:
        """Copy page `source` into page `target` in every layer."""
        for cache in (*self.k, *self.v):
            cache[target].copy_(cache[source])
