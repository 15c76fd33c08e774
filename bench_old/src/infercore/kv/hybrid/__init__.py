"""Multi-granularity KV memory for hybrid models (full attention + sliding window + linear state).

Models declare one spec per layer; :class:`HybridKVLayout` groups identical layers and sizes the
small pages (per group) and the large pages (their least common multiple);
:class:`HybridBlockManager` hands out small pages and state slots per request, releases sliding
pages that leave the window, checkpoints linear states for prefix caching, and serves a prefix hit
only as far as every layer type can. ``HybridKVLayout.build(..., mode="uniform")`` gives the
one-page-size baseline for comparison.
"""

from .layout import HybridKVLayout, LayerGroup
from .manager import PAD_PAGE, HybridBlockManager, StateCopy
from .pool import TwoLevelPool
from .spec import (
    FullAttentionSpec,
    LinearStateSpec,
    SlidingWindowSpec,
    bytes_per_state,
    bytes_per_token,
    normalize_spec,
    spec_kind,
)

__all__ = [
    "PAD_PAGE",
    "FullAttentionSpec",
    "HybridBlockManager",
    "HybridKVLayout",
    "LayerGroup",
    "LinearStateSpec",
    "SlidingWindowSpec",
    "StateCopy",
    "TwoLevelPool",
    "bytes_per_state",
    "bytes_per_token",
    "normalize_spec",
    "spec_kind",
]
