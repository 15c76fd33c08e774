"""KV cache tensors for paged full attention, and how many pages a memory budget holds.

Layout (per layer): ``k_cache`` and ``v_cache`` are ``[num_pages, page_size, Hk, D]``, contiguous;
token slot ``s = page * page_size + offset`` is row ``s`` of the ``[num_pages * page_size, Hk, D]``
view. All layers share page ids, so one block table addresses every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVSpec(Protocol):
    """What the allocator reads from a spec (e.g. :class:`infercore.kv.FullAttentionSpec`)."""

    num_kv_heads: int
    head_dim: int


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
    if dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name} must be a real floating or integer dtype, got {dtype}")
    return dtype


def _layer_shapes(specs: Sequence[KVSpec], dtype: torch.dtype) -> list[tuple[int, int, torch.dtype]]:
    """``(Hk, D, dtype)`` of each layer, validated; a spec's own dtype overrides ``dtype``."""
    _check_dtype("dtype", dtype)
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise TypeError(f"specs must be a sequence of KV specs, got {type(specs).__name__}")
    if len(specs) == 0:
        raise ValueError("specs must hold at least one layer spec")
    out = []
    for i, spec in enumerate(specs):
        try:
            hk, d = spec.num_kv_heads, spec.head_dim
        except AttributeError:
            raise TypeError(
                f"specs[{i}] ({type(spec).__name__}) has no num_kv_heads/head_dim: "
                "only full-attention specs are paged here"
            ) from None
        _check_positive(f"specs[{i}].num_kv_heads", hk)
        _check_positive(f"specs[{i}].head_dim", d)
        layer_dtype = getattr(spec, "dtype", None)
        out.append((hk, d, dtype if layer_dtype is None else _check_dtype(f"specs[{i}].dtype", layer_dtype)))
    return out


def bytes_per_page(specs: Sequence[KVSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page id costs across all layers: ``sum 2 * page_size * Hk * D * itemsize``."""
    _check_positive("page_size", page_size)
    return sum(2 * page_size * hk * d * dt.itemsize for hk, d, dt in _layer_shapes(specs, dtype))


def pages_for_budget(
    specs: Sequence[KVSpec], page_size: int, *, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many pages (shared by all layers) fit in ``budget_bytes``; may be 0."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // bytes_per_page(specs, page_size, dtype=dtype)


def allocate_kv_caches(
    specs: Sequence[KVSpec],
    num_pages: int,
    page_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(k_cache, v_cache)`` pair per spec, each ``[num_pages, page_size, Hk, D]``.

    Tensors are zero-filled: attention kernels may load (then mask) slots that were never
    written, and stale NaN/Inf bit patterns there would poison masked arithmetic.
    ``dtype`` applies to layers whose spec has ``dtype=None``.
    """
    _check_positive("num_pages", num_pages)
    _check_positive("page_size", page_size)
    shapes = _layer_shapes(specs, dtype)
    device = torch.device(device)
    caches = []
    for hk, d, dt in shapes:
        shape = (num_pages, page_size, hk, d)
        caches.append(
            (torch.zeros(shape, dtype=dt, device=device), torch.zeros(shape, dtype=dt, device=device))
        )
    return caches
