"""Content hashes for prefix caching, shared by every KV manager.

A page's key is a hash chain: ``h_i = sha256(h_{i-1} || token ids of page i)``, with ``h_{-1}``
the root (optionally salted by ``extra_key``, e.g. a LoRA id or image hashes, so that equal token
ids under different conditioning never share KV). Because each key commits to the whole prefix,
two requests share page ``i`` only if their first ``(i + 1) * page_size`` tokens agree; KV is a
function of the whole prefix, so this is exactly the condition under which reuse is correct.

SHA-256 (not Python's ``hash``) makes an accidental collision between different prefixes
practically impossible; managers additionally keep each cached page's own token ids and compare
them on a hit, so a bug or collision in the chain can at worst cause a miss on that page's tokens.
Token ids are encoded as little-endian int64, so any id in ``[-2**63, 2**63)`` is valid.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_DOMAIN = b"infercore.kv.prefix.v1"
ROOT_HASH: bytes = hashlib.sha256(_DOMAIN).digest()


def root_hash(extra_key: bytes | None = None) -> bytes:
    """The parent hash of a sequence's first page; ``extra_key`` salts the whole chain."""
    if extra_key is None:
        return ROOT_HASH
    if not isinstance(extra_key, (bytes, bytearray)):
        raise TypeError(f"extra_key must be bytes or None, got {type(extra_key).__name__}")
    return hashlib.sha256(_DOMAIN + b"\x00" + bytes(extra_key)).digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        buf = array("q", tokens)
    # Managers hash a page before they book it, so these leave their state consistent.
    except OverflowError as e:
        raise ValueError(f"token_ids must be ints in [-2**63, 2**63) ({e})") from None
    except TypeError as e:
        raise TypeError(f"token_ids must be ints ({e})") from None
    if sys.byteorder != "little":  # keep keys identical across hosts (e.g. for a shared CPU tier)
        buf.byteswap()
    return buf.tobytes()


def hash_page(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of one page given its parent's key and the page's token ids (32 bytes)."""
    h = hashlib.sha256(parent)
    h.update(_token_bytes(tokens))
    return h.digest()


def hash_pages(
    token_ids: Sequence[int], page_size: int, *, num_pages: int | None = None, parent: bytes = ROOT_HASH
) -> list[bytes]:
    """Keys of the first ``num_pages`` full pages of ``token_ids`` (all full pages if None)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    full = len(token_ids) // page_size
    n = full if num_pages is None else min(num_pages, full)
    out: list[bytes] = []
    for i in range(n):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size])
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens, over successful admissions.

    ``query_tokens`` counts the prompt tokens that were looked up, ``hit_tokens`` those served
    from cached pages, ``cpu_hit_tokens`` the part of ``hit_tokens`` loaded from a CPU tier. Failed
    admissions (pool short) are not counted: they are retried.
    """

    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    cpu_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def reset(self) -> None:
        self.requests = self.query_tokens = self.hit_tokens = self.cpu_hit_tokens = 0
