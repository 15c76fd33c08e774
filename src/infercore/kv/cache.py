"""KV cache tensors for paged full attention, and how many pages a memory budget holds.

Layout (per layer): ``k_cache`` and ``v_cache`` are ``[num_pages, page_size, Hk, D]``, contiguous;
token slot ``s = page * page_size + offset`` is row ``s`` of the ``[num_pages * page_size, Hk, D]``
view. All layers share page ids, so one block table addresses every layer.

Quantized KV (``kv_cache_dtype="int8"`` or ``"fp8"``): each layer's entry is a
:class:`QuantizedKVCache`, still the ``(k_cache, v_cache)`` pair (1-byte codes) with fp32
``k_scale``/``v_scale`` ``[num_pages, page_size, Hk]`` attached (one scale per token and KV head, see
``infercore.ops.kv_cache.quant``). A page then costs ``2 * page_size * Hk * (D + 4)`` bytes instead of
``2 * page_size * Hk * D * 2`` in bf16: the same budget holds 1.94x the tokens at D=128.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..devices import check_device

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_SCALE_BYTES = 4  # one fp32 scale per (token, KV head)


class QuantizedKVCache(tuple):
    """One layer's quantized cache: unpacks as ``(k_cache, v_cache)`` (int8 / float8_e4m3fn codes,
    ``[num_pages, page_size, Hk, D]``) and carries ``k_scale``/``v_scale`` fp32 ``[num_pages, page_size, Hk]``.

    A pair, so code that only moves pages keeps working; code that reads values must pass the scales
    (the ops raise when a quantized cache comes without them).
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor):
        self = super().__new__(cls, (k_cache, v_cache))
        self.k_scale, self.v_scale = k_scale, v_scale
        return self

    def __reduce__(self):
        return (QuantizedKVCache, (self[0], self[1], self.k_scale, self.v_scale))


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"auto"``/None -> None (the model's dtype); ``"int8"`` -> int8; ``"fp8"``/``"fp8_e4m3"`` ->
    float8_e4m3fn; a torch dtype passes through. Raises ``ValueError`` naming the choices."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return None
    if isinstance(kv_cache_dtype, torch.dtype):
        return _check_dtype("kv_cache_dtype", kv_cache_dtype)
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]} or a torch.dtype, "
                     f"got {kv_cache_dtype!r}")  # fmt: skip


def _quantized(kv_cache_dtype: str | torch.dtype | None) -> bool:
    return resolve_kv_cache_dtype(kv_cache_dtype) in (torch.int8, torch.float8_e4m3fn)


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


def _layer_shapes(
    specs: Sequence[KVSpec], dtype: torch.dtype, kv_cache_dtype: str | torch.dtype | None = None
) -> list[tuple[int, int, torch.dtype, bool]]:
    """``(Hk, D, dtype, shared)`` of each layer, validated; a spec's own dtype overrides ``dtype``, and a
    non-auto ``kv_cache_dtype`` overrides both (the storage format is an engine choice). ``shared``: the
    spec's ``shared_kv`` (one tensor serves as keys and values)."""
    _check_dtype("dtype", dtype)
    forced = resolve_kv_cache_dtype(kv_cache_dtype)
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
        if forced is not None:
            layer_dtype = forced
        shared = getattr(spec, "shared_kv", False) is True
        if shared and _quantized(kv_cache_dtype):
            # keys and values would each want their own scales in the one tensor
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: specs[{i}] keeps keys and values in one tensor "
                             "(shared_kv, a latent-attention cache), which int8 / fp8 KV does not support; use 'auto'")
        out.append((hk, d, dtype if layer_dtype is None else _check_dtype(f"specs[{i}].dtype", layer_dtype), shared))
    return out


def bytes_per_page(
    specs: Sequence[KVSpec], page_size: int, dtype: torch.dtype, *, kv_cache_dtype: str | torch.dtype | None = None
) -> int:
    """Bytes one page id costs across all layers: ``sum 2 * page_size * Hk * D * itemsize`` (once, not twice, for a
    ``shared_kv`` layer), plus ``2 * page_size * Hk * 4`` scale bytes for int8 / fp8 layers (``kv_cache_dtype``, see
    :func:`resolve_kv_cache_dtype`)."""
    _check_positive("page_size", page_size)
    # Scales exist only for caches quantized through kv_cache_dtype; a plain ``dtype`` of int8/fp8
    # keeps its old meaning (storage cast, no scales).
    scale = _SCALE_BYTES if _quantized(kv_cache_dtype) else 0
    shapes = _layer_shapes(specs, dtype, kv_cache_dtype)
    return sum((1 if shared else 2) * page_size * hk * (d * dt.itemsize + scale) for hk, d, dt, shared in shapes)


def pages_for_budget(
    specs: Sequence[KVSpec],
    page_size: int,
    *,
    dtype: torch.dtype,
    budget_bytes: int,
    kv_cache_dtype: str | torch.dtype | None = None,
) -> int:
    """How many pages (shared by all layers) fit in ``budget_bytes``; may be 0."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // bytes_per_page(specs, page_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


def allocate_kv_caches(
    specs: Sequence[KVSpec],
    num_pages: int,
    page_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str | torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(k_cache, v_cache)`` pair per spec, each ``[num_pages, page_size, Hk, D]`` (for a ``shared_kv`` spec
    one tensor, given as both).

    Tensors are zero-filled: attention kernels may load (then mask) slots that were never
    written, and stale NaN/Inf bit patterns there would poison masked arithmetic.
    ``dtype`` applies to layers whose spec has ``dtype=None``. ``kv_cache_dtype`` ``"auto"``
    (default) keeps that; ``"int8"`` / ``"fp8"`` store 1-byte codes for every layer and return
    :class:`QuantizedKVCache` pairs carrying fp32 ``k_scale``/``v_scale`` ``[num_pages, page_size, Hk]``
    (the only way to get scales: ``dtype=torch.int8`` alone allocates plain tensors, as before).
    """
    _check_positive("num_pages", num_pages)
    _check_positive("page_size", page_size)
    shapes = _layer_shapes(specs, dtype, kv_cache_dtype)
    device = check_device(device)
    caches = []
    for hk, d, dt, shared in shapes:
        shape = (num_pages, page_size, hk, d)
        k = torch.zeros(shape, dtype=dt, device=device)
        v = k if shared else torch.zeros(shape, dtype=dt, device=device)
        if _quantized(kv_cache_dtype):
            zs = (num_pages, page_size, hk)
            caches.append(QuantizedKVCache(k, v, torch.zeros(zs, device=device), torch.zeros(zs, device=device)))
        else:
            caches.append((k, v))
    return caches
