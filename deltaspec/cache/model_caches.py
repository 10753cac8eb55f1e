"""`ModelCaches`: the caches one model's forward pass reads and writes."""

from dataclasses import dataclass

from deltaspec.cache.kv_cache import PagedKVCache
from deltaspec.cache.state_cache import GDNStateCache


@dataclass
class ModelCaches:
    """Attention pages and GDN state slots of one model."""

    kv: PagedKVCache
    gdn: GDNStateCache
