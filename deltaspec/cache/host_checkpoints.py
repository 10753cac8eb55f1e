"""Prefix checkpoints offloaded to host memory (`--prefix-offload-gib`).

A checkpoint evicted from the device (its slot or its pages were needed) can be kept in host memory
instead of dropped: a copy of its GDN states and conv windows and of the KV of its prefix, in pinned
memory on a CUDA machine. A request that matches it gets fresh pages with that KV copied in and its
state slot loaded, and prefills only the rest, as from a device checkpoint. Host checkpoints are
evicted least recently used first to stay within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.state_cache import GDNStateCache


@dataclass
class HostCheckpoint:
    key: int  # its content address (as the device checkpoint's)
    tokens: tuple[int, ...]
    states: list[torch.Tensor]  # per GDN layer: [Hv, Dk, Dv]
    convs: list[torch.Tensor]  # per GDN layer: [K-1, conv_dim]
    pages: list[torch.Tensor]  # per KV tensor (K and V of every layer): [pages, block_size, Hkv, D]
    last_used: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.states, *self.convs, *self.pages))


class HostCheckpoints:
    def __init__(self, budget_bytes: int, kv: PagedKVCache, gdn: GDNStateCache, clock: Callable[[], int]):
        self.budget, self.kv, self.gdn, self.clock = budget_bytes, kv, gdn, clock
        self.entries: dict[int, HostCheckpoint] = {}
        self.hits = 0

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.is_cuda
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned).copy_(tensor)

    def offload(self, key: int, tokens: tuple[int, ...], slot: int, blocks: list[int]) -> None:
        """Keep a host copy of the checkpoint of `tokens` (state slot `slot`, KV pages `blocks`)."""
        if not self.budget or key in self.entries:
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        entry = HostCheckpoint(
            key,
            tokens,
            [self._host_copy(s[slot]) for s in self.gdn.state],
            [self._host_copy(c[slot]) for c in self.gdn.conv],
            [self._host_copy(cache.index_select(0, index)) for cache in self.kv.byte_views()],
            self.clock(),
        )
        if entry.nbytes > self.budget:
            return
        while sum(e.nbytes for e in self.entries.values()) + entry.nbytes > self.budget:
            self.entries.pop(min(self.entries, key=lambda k: self.entries[k].last_used))
        self.entries[key] = entry

    def restore(self, entry: HostCheckpoint, slot: int) -> list[int] | None:
        """Load `entry` into state slot `slot` and fresh pages; returns the pages, or None when there are
        not enough free pages (the sequence then prefills in full)."""
        count = entry.pages[0].shape[0]
        if self.kv.allocator.num_free < count:
            return None
        blocks = self.kv.allocator.allocate(count)
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        for cache, saved in zip(self.kv.byte_views(), entry.pages):
            cache.index_copy_(0, index, saved.to(cache.device, non_blocking=True))
        for state, conv, saved_state, saved_conv in zip(self.gdn.state, self.gdn.conv, entry.states, entry.convs):
            state[slot].copy_(saved_state, non_blocking=True)
            conv[slot].copy_(saved_conv, non_blocking=True)
        entry.last_used = self.clock()
        self.hits += 1
        return blocks
