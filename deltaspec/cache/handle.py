"""`CacheHandle`: one sequence's place in the caches, the part of a sequence the cache layer reads and writes.

It holds the sequence's GDN state slot, its KV pages (its block table), how many of its tokens have run
(`num_computed`) and how many of those were resumed from a prefix checkpoint, and its replay-log cursor. The
`CacheManager` hands out and takes back the slot and pages, resumes from checkpoints and moves the cursor; the
scheduler, the runner and the speculator read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaspec.cache.replay import ReplayCursor


@dataclass
class CacheHandle:
    state_slot: int | None = None  # its GDN state slot while it runs
    blocks: list[int] = field(default_factory=list)  # its KV pages: token p at page blocks[p // block_size]
    num_computed: int = 0  # its tokens whose rows have run
    num_cached_tokens: int = 0  # of those, the tokens resumed from a prefix checkpoint instead of computed
    replay: ReplayCursor = field(default_factory=ReplayCursor)  # moved by the cache manager only

    def kv_slots(self, positions: list[int], block_size: int) -> list[int]:
        """The flat KV cache slots (page * block_size + offset) of the tokens at `positions`."""
        return [self.blocks[p // block_size] * block_size + p % block_size for p in positions]
