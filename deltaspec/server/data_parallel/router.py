"""Which data-parallel replica serves a request: prefix affinity, else the least-loaded replica (SGLang's
cache-aware policy, on text as its router judges it). No HTTP here: the front door asks, this module decides.

Each replica has a `PrefixIndex`, an approximate record of the prompts routed to it: a prompt is cut into blocks of
`block_chars` characters, and block i is known by the hash of blocks 0..i (`block_keys`), so each key names one node
of a prefix tree whose edges are blocks, and two prompts share a key exactly where they share every block up to it.
A replica's match for a prompt is how many of its leading keys the index holds. The index keeps at most
`max_blocks` keys and evicts the least recently used first; a prompt's keys are refreshed leaf first, so a prefix is
always fresher than its continuations and eviction cuts paths from their ends, never from their roots.

`PrefixRouter.choose`, in order:
- when the load is out of balance (the busiest replica has more than `balance_abs_threshold` requests in flight
  over the idlest and more than `balance_rel_threshold` times its count), the least-loaded replica (`balance`);
- else the replica with the longest match, when that match covers at least `cache_threshold` of the prompt
  (`prefix`);
- else the least-loaded replica, the one with the smallest index among equals, so that unrelated prompts
  spread over the replicas (`load`).
A generating request's keys are then recorded in the chosen replica's index (the engine keeps a prefix checkpoint
of the prompt it serves). Replicas marked down are never chosen; with none up, `choose` raises `NoReplica`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

ROUTES = ("prefix", "load", "balance")  # why a replica was chosen, as the metrics label it


@dataclass(frozen=True)
class RouterSettings:
    """The policy's thresholds (SGLang's router defaults) and the size of each replica's index."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    block_chars: int = 64
    max_blocks: int = 1 << 16  # per replica: 4 MiB of prompt text at 64 characters a block


@dataclass(frozen=True)
class Prompt:
    """What routing knows of a request: its text's length and the chain keys of its whole blocks."""

    length: int
    keys: tuple[int, ...]


@dataclass(frozen=True)
class Route:
    """The replica chosen, why (one of `ROUTES`), and how many of the prompt's characters its index matched."""

    replica: int
    reason: str
    matched_chars: int


class NoReplica(Exception):
    """Every replica is marked down."""


def prompt_of(text: str, block_chars: int) -> Prompt:
    """`text`'s routing keys: block i's key is the hash of block i's characters and block i-1's key (a partial last
    block has none)."""
    keys, key = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = hash((key, text[start : start + block_chars]))
        keys.append(key)
    return Prompt(len(text), tuple(keys))


class PrefixIndex:
    """The block keys of prompts routed to one replica, at most `max_blocks`, least recently used evicted first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def matched_blocks(self, keys: tuple[int, ...]) -> int:
        """How many of `keys`, from the first, this index holds."""
        for held, key in enumerate(keys):
            if key not in self._keys:
                return held
        return len(keys)

    def insert(self, keys: tuple[int, ...]) -> None:
        """Record `keys` as the most recently used, the first (the root) freshest, then evict down to the bound."""
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)


class PrefixRouter:
    """The routing policy over `replicas` replicas, their requests in flight and which of them are up."""

    def __init__(self, replicas: int, settings: RouterSettings = RouterSettings()) -> None:
        self.settings = settings
        self.indexes = [PrefixIndex(settings.max_blocks) for _ in range(replicas)]
        self.in_flight = [0] * replicas
        self.up = [True] * replicas
        self.routed: Counter[tuple[int, str]] = Counter()  # (replica, reason) -> requests

    def prompt(self, text: str) -> Prompt:
        return prompt_of(text, self.settings.block_chars)

    def choose(self, prompt: Prompt | None) -> Route:
        """The replica for a request: a generating one's `prompt` is matched and recorded; None (any other request)
        goes to the least-loaded replica and leaves the indexes as they are."""
        live = [i for i, up in enumerate(self.up) if up]
        if not live:
            raise NoReplica
        loads = [self.in_flight[i] for i in live]
        least_loaded = min(live, key=lambda i: (self.in_flight[i], len(self.indexes[i]), i))
        if prompt is None:
            route = Route(least_loaded, "load", 0)
        else:
            route = self._route(prompt, live, least_loaded, max(loads), min(loads))
            self.indexes[route.replica].insert(prompt.keys)
        self.routed[route.replica, route.reason] += 1
        return route

    def _route(self, prompt: Prompt, live: list[int], least_loaded: int, most: int, fewest: int) -> Route:
        block = self.settings.block_chars
        matched = {i: self.indexes[i].matched_blocks(prompt.keys) * block for i in live}
        settings = self.settings
        if most - fewest > settings.balance_abs_threshold and most > fewest * settings.balance_rel_threshold:
            return Route(least_loaded, "balance", matched[least_loaded])
        best = max(live, key=lambda i: (matched[i], -self.in_flight[i], -i))
        if matched[best] and matched[best] >= settings.cache_threshold * prompt.length:
            return Route(best, "prefix", matched[best])
        return Route(least_loaded, "load", matched[least_loaded])

    def started(self, replica: int) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1
