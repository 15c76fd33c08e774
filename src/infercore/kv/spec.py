"""Per-layer KV cache specifications: plain data that models declare and ``kv`` consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    """KV needs of one attention layer that keeps keys and values for every position.

    Attributes:
        num_kv_heads: ``Hk``, key/value heads of this layer (after any tensor-parallel split).
        head_dim: ``D``, per-head dimension of keys and values.
        dtype: cache dtype of this layer; None means the dtype passed to the allocator.
        sliding_window: HF ``sliding_window=w`` (a token sees the last ``w`` keys including
            itself), or None for full attention. The full-attention manager still stores every
            position; the window only masks attention.
        shared_kv: keys and values are one tensor (multi-head latent attention keeps one latent per
            token that serves as both): the allocator makes one ``[num_pages, page_size, Hk, D]``
            tensor for the layer and hands it out as the pair ``(cache, cache)``.
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | None = None
    sliding_window: int | None = None
    shared_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {self.dtype!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {w!r}")
        if not isinstance(self.shared_kv, bool):
            raise TypeError(f"shared_kv must be a bool, got {self.shared_kv!r}")
