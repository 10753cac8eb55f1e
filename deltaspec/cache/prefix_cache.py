"""Prefix checkpoints (DESIGN §4): a follow-up about a long document costs the follow-up, not the document.

A GDN state cannot be truncated, so reuse works at checkpoints: at chosen positions p a sequence's
recurrent state and conv window (every GDN layer) are copied into a checkpoint slot of the state
cache, and the KV pages holding tokens [0, p) get one more reference. A new request whose tokens
start with the checkpoint's p tokens (and go on past them) resumes there: its state slot gets the
checkpoint's state, its page table starts with the checkpoint's full pages (shared: no one writes
below a sequence's computed length) and a private copy of the partly filled last page, and only
tokens from p on are prefilled.

Checkpoints are addressed by content: a hash chain over the token blocks of the page size (each
block's hash covers every token before it), plus the tokens of the partial last block; a match is
confirmed token by token. The pool holds `capacity` checkpoints and evicts one when it is full, or when pages
run short (a checkpoint's pages go back to the pool once no sequence shares them), into host memory when
`offload_bytes` allows (`deltaspec.cache.host_checkpoints`): the least recently used of those that were saved
into a free slot only, then of the others (the places a request said it will resume from: where a chat's next
turn parts, a long prompt's tail). Running sequences never lose pages to eviction.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from deltaspec.cache.host_checkpoints import HostCheckpoint, HostCheckpoints
from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.state_cache import GDNStateCache


def block_hashes(tokens: list[int], block_size: int, chain: list[int] | None = None) -> list[int]:
    """hashes[i]: the chain hash of tokens[: i * block_size] (hashes[0] is the empty prefix); `chain`, the chain of
    a prefix of `tokens` already hashed, is extended in place."""
    hashes = [0] if chain is None else chain
    for start in range((len(hashes) - 1) * block_size, len(tokens) - block_size + 1, block_size):
        hashes.append(hash((hashes[-1], tuple(tokens[start : start + block_size]))))
    return hashes


class HashChains:
    """The block-hash chains (`block_hashes`) of the last few token lists hashed: a list that extends one of them,
    or is its prefix (a follow-up about a long document, a finished request's prompt and answer), reuses its chain
    and hashes only its new blocks, so a lookup or save after a 63k-token prompt costs a list comparison instead of
    4000 block hashes."""

    def __init__(self, block_size: int, keep: int = 4):
        self.block_size, self.keep = block_size, keep
        self.recent: list[tuple[list[int], list[int]]] = []  # (tokens, their chain), most recent first

    def __call__(self, tokens: list[int]) -> list[int]:
        size, n = self.block_size, len(tokens)
        for i, (saved, chain) in enumerate(self.recent):
            if len(saved) >= n and saved[:n] == tokens:  # a prefix of a hashed list
                self.recent.insert(0, self.recent.pop(i))
                return chain[: n // size + 1]
            if len(saved) < n and tokens[: len(saved)] == saved:  # it extends a hashed list
                self.recent.pop(i)
                chain = block_hashes(tokens, size, list(chain))
                break
        else:
            chain = block_hashes(tokens, size)
        self.recent = [(list(tokens), chain), *self.recent[: self.keep - 1]]
        return chain


def prefix_key(tokens: list[int], length: int, block_size: int, hashes: list[int]) -> int:
    """The content address of tokens[:length]: the chain hash of its full blocks and its partial tail."""
    full = length // block_size
    return hash((length, hashes[full], tuple(tokens[full * block_size : length])))


@dataclass
class Checkpoint:
    key: int  # its content address
    tokens: tuple[int, ...]  # the prefix it holds the state of
    slot: int  # its slot in the state cache
    blocks: list[int]  # KV pages of tokens [0, len(tokens)), one reference each
    last_used: int
    resume_point: bool  # saved with the right to evict others (evicted only after those saved without it)


class PrefixCache:
    def __init__(self, kv: PagedKVCache, gdn: GDNStateCache, offload_bytes: int = 0):
        self.kv, self.gdn = kv, gdn
        self.block_size = kv.block_size
        self.chains = HashChains(self.block_size)
        self.checkpoints: dict[int, Checkpoint] = {}  # content address -> checkpoint
        self._free_slots = list(gdn.checkpoint_slots)
        self._clock = itertools.count()
        self.host = HostCheckpoints(offload_bytes, kv, gdn, lambda: next(self._clock))
        self.hits = 0
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return len(self.gdn.checkpoint_slots)

    def pages_held_only_here(self) -> int:
        """KV pages that only checkpoints hold (no sequence): cached, and freed by eviction."""
        holders: dict[int, int] = {}
        for checkpoint in self.checkpoints.values():
            for block in checkpoint.blocks:
                holders[block] = holders.get(block, 0) + 1
        return sum(count == self.kv.allocator.refs(block) for block, count in holders.items())

    def lookup(self, tokens: list[int], touch: bool = True) -> Checkpoint | HostCheckpoint | None:
        """The deepest checkpoint, on the device or offloaded, whose prefix `tokens` continues past (at least
        one token left to compute); `touch` marks it used (a mere estimate, such as the scheduler's, does not)."""
        if not self.checkpoints and not self.host.entries:
            return None
        hashes = self.chains(tokens)
        lengths = {len(c.tokens) for c in (*self.checkpoints.values(), *self.host.entries.values())}
        for length in sorted(lengths, reverse=True):
            if length >= len(tokens):
                continue
            key = prefix_key(tokens, length, self.block_size, hashes)
            found = self.checkpoints.get(key) or self.host.entries.get(key)
            if found is not None and found.tokens == tuple(tokens[:length]):
                if touch:
                    found.last_used = next(self._clock)
                return found
        return None

    def resume(self, checkpoint: Checkpoint | HostCheckpoint, slot: int) -> list[int] | None:
        """Load `checkpoint` into state slot `slot`; returns the page table of its prefix for a new sequence
        (shared full pages, a private copy of the partial last page), or None when no page can be had for
        that copy (the sequence then prefills in full). With no free page, a partial page that only the
        checkpoint holds is handed over to the sequence and the checkpoint is dropped. An offloaded
        checkpoint is copied back into fresh pages."""
        length = len(checkpoint.tokens)
        if isinstance(checkpoint, HostCheckpoint):
            self.evict_for_pages(-(-length // self.block_size))
            blocks = self.host.restore(checkpoint, slot)
            self.hits += blocks is not None
            return blocks
        full, partial = divmod(length, self.block_size)
        if partial:
            self.evict_for_pages(1, keep=checkpoint)
            if not self.kv.allocator.num_free and self.kv.allocator.refs(checkpoint.blocks[full]) > 1:
                return None
        self.gdn.copy_slot(checkpoint.slot, slot)
        shared = checkpoint.blocks[:full]
        self.kv.allocator.share(shared)
        self.hits += 1
        if not partial:
            return list(shared)
        if self.kv.allocator.num_free:
            private = self.kv.allocator.allocate(1)[0]
            self.kv.copy_block(checkpoint.blocks[full], private)
            return [*shared, private]
        page = checkpoint.blocks[full]
        self.kv.allocator.share([page])  # the sequence's reference; dropping the checkpoint leaves it the only one
        self._drop(checkpoint.key)
        return [*shared, page]

    def save(self, tokens: list[int], slot: int, blocks: list[int], evict: bool = True) -> None:
        """Checkpoint the state in `slot`, which has consumed exactly `tokens`, with the pages holding them; when
        no slot is free, evict one for it (`_evict_one`; or, without `evict`, keep nothing)."""
        length = len(tokens)
        key = prefix_key(tokens, length, self.block_size, self.chains(tokens))
        if key in self.checkpoints and self.checkpoints[key].tokens == tuple(tokens):
            self.checkpoints[key].last_used = next(self._clock)
            self.checkpoints[key].resume_point |= evict
            return
        if not self._free_slots and evict and self.checkpoints:
            self._evict_one()
        if not self._free_slots:
            return
        checkpoint_slot = self._free_slots.pop()
        self.gdn.copy_slot(slot, checkpoint_slot)
        pages = blocks[: -(-length // self.block_size)]
        self.kv.allocator.share(pages)
        self.checkpoints[key] = Checkpoint(key, tuple(tokens), checkpoint_slot, list(pages), next(self._clock), evict)

    def evict_for_pages(self, needed: int, keep: Checkpoint | None = None) -> None:
        """Evict least recently used checkpoints (but `keep`) until `needed` pages are free or none is left."""
        while self.kv.allocator.num_free < needed and any(c is not keep for c in self.checkpoints.values()):
            self._evict_one(keep)

    def _evict_one(self, keep: Checkpoint | None = None) -> None:
        """Evict the least recently used checkpoint (but `keep`) of those saved into a free slot only, else of all."""
        candidates = (k for k, c in self.checkpoints.items() if c is not keep)
        key = min(candidates, key=lambda k: (self.checkpoints[k].resume_point, self.checkpoints[k].last_used))
        victim = self.checkpoints[key]
        self.host.offload(key, victim.tokens, victim.slot, victim.blocks)
        self._drop(key)
        self.evictions += 1

    def _drop(self, key: int) -> None:
        checkpoint = self.checkpoints.pop(key)
        self.kv.allocator.free(checkpoint.blocks)
        self._free_slots.append(checkpoint.slot)
