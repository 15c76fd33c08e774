"""Paged KV memory: which pages a request holds, and the cache tensors they index.

``kv`` knows nothing of models: models declare per-layer specs (:class:`FullAttentionSpec`),
:func:`allocate_kv_caches` turns them into tensors, and :class:`BlockManager` hands out page ids
and slot indices that the attention ops consume.
"""

from .block_manager import BlockManager
from .cache import QuantizedKVCache, allocate_kv_caches, bytes_per_page, pages_for_budget, resolve_kv_cache_dtype
from .cpu_tier import CPUKVTier, CPUTierStats
from .prefix_cache import PrefixCacheStats, hash_page, hash_pages, root_hash
from .spec import FullAttentionSpec

__all__ = [
    "BlockManager",
    "CPUKVTier",
    "CPUTierStats",
    "FullAttentionSpec",
    "PrefixCacheStats",
    "QuantizedKVCache",
    "allocate_kv_caches",
    "bytes_per_page",
    "hash_page",
    "hash_pages",
    "pages_for_budget",
    "resolve_kv_cache_dtype",
    "root_hash",
]
