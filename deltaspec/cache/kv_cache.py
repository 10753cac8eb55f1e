"""Paged KV cache for the attention layers, and the allocator of its pages.

One pair of tensors per attention layer (the MTP head's layers included), each
[num_blocks, block_size, Hkv, D]; a sequence owns a list of pages (its block table) and token p
of the sequence lives at page `table[p // block_size]`, offset `p % block_size`.
"""

import torch

from deltaspec.errors import DeltaspecError


class BlockAllocator:
    """Free list of KV pages."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise DeltaspecError(
                f"The KV cache is out of pages ({count} needed, {len(self._free)} free); "
                "allocate more with --num-kv-blocks or run fewer sequences at once.")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """K and V pages of every attention layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
