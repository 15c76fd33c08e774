"""Quantized paged KV: INT8 and FP8 (e4m3) codes with one fp32 scale per (token, KV head).

Layout: code caches ``[num_pages, page_size, Hk, D]`` int8 or float8_e4m3fn; scale caches
``[num_pages, page_size, Hk]`` fp32, addressed by the same slot (``page * page_size + offset``).
``x ~= code * scale`` with ``scale = max(amax_D |x|, eps) / qmax`` (qmax 127 for INT8, 448 for e4m3)
and INT8 codes rounded half away from zero.

Why per (token, head) for both formats: the cache is written once per token and never rewritten,
so a dynamic scale can only be chosen from the values at hand (no calibration pass, no overflow of
a stale per-tensor scale when a later token has an outlier key); keys of one head can be 10-50x
larger than another's, which a per-tensor INT8 scale would flatten. For e4m3 the relative precision
is scale-invariant, so the per-token scale mainly buys overflow safety and full use of the range; it
costs 4 bytes per ``D`` codes (3% at D=128) and one multiply per score/probability column in the
kernels, and lets INT8 and FP8 share one kernel path.
"""

from __future__ import annotations

import torch

# Shared with infercore.quant, which imports them from here (quant sits above ops).
E4M3_MAX = 448.0
INT8_MAX = 127.0
SCALE_EPS = 1e-8

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """True for the cache dtypes that carry side scales (int8, float8_e4m3fn)."""
    return dtype in (torch.int8, torch.float8_e4m3fn)


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """The INT8 rounding every quantizer of the project uses (KV and weights/activations in
    ``infercore.quant``; the kernels implement the same formula)."""
    return torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5))


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` float -> ``(codes [..., D] cache_dtype, scale [...] fp32)``."""
    xf = x.float()
    qmax = INT8_MAX if cache_dtype == torch.int8 else E4M3_MAX
    scale = xf.abs().amax(-1).clamp_min(SCALE_EPS) / qmax
    v = xf / scale[..., None]
    if cache_dtype == torch.int8:
        return round_half_away(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_kv_ref(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes [..., D]`` times ``scale [...]`` -> ``dtype``."""
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


def check_kv_scales(
    op: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate the scale caches against the code caches; returns whether the cache is quantized.

    A quantized cache without scales (or scales beside a float cache) is an error, never a silent
    misread of codes as values.
    """
    quant = is_quantized_kv(k_cache.dtype)
    if not quant:
        if k_scale is not None or v_scale is not None:
            raise TypeError(f"{op}: k_scale/v_scale given but the cache dtype is {k_cache.dtype} (not int8/fp8)")
        return False
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{op}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    for name, s, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if s is None:
            raise ValueError(f"{op}: a {cache.dtype} KV cache needs {name} (fp32 [num_pages, page_size, Hk])")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be an fp32 tensor, got {getattr(s, 'dtype', type(s).__name__)}")
        if tuple(s.shape) != tuple(cache.shape[:3]):
            raise ValueError(f"{op}: {name} has shape {tuple(s.shape)}, expected {tuple(cache.shape[:3])}")
        if s.device != cache.device:
            raise ValueError(f"{op}: {name} is on {s.device} but the cache is on {cache.device}")
        if not s.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    return True


def write_kv_cache_quantized_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize ``k``/``v`` ``[T, Hk, D]`` and scatter codes and scales to their slots, in place."""
    keep = slot_mapping >= 0
    page, off = paged_index(slot_mapping[keep], k_cache.shape[1])
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, s = quantize_kv_ref(x[keep], cache.dtype)
        # float8 has no index_put kernel on the CPU; the byte view moves the same bits.
        if cache.dtype == torch.float8_e4m3fn:
            cache.view(torch.uint8)[page, off] = codes.view(torch.uint8)
        else:
            cache[page, off] = codes
        sc[page, off] = s


def paged_index(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``slots`` (any int dtype, ``[T]``, no -1) -> int64 ``(page, offset in page)``, for indexed
    stores into ``[num_pages, page_size, ...]`` caches of any page stride."""
    slots = slots.long()
    return slots // page_size, slots % page_size


def dequantize_paged_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dequantize the pages a batch reads into a compact temporary cache, for kernels without
    quantized-KV support (prefill with a cached prefix).

    Args:
        k_cache, v_cache: int8/float8_e4m3fn ``[num_pages, page_size, Hk, D]``.
        k_scale, v_scale: fp32 ``[num_pages, page_size, Hk]``.
        block_table: int32 ``[B, max_pages]``; seq_lens: int32 ``[B]`` (pages past
            ``cdiv(seq_lens[b], page_size)`` are ignored).
        dtype: dtype of the temporary caches (the query dtype).

    Returns:
        ``(k_tmp, v_tmp, block_table_tmp)``: ``[U, page_size, Hk, D]`` caches holding only the ``U``
        distinct pages used (shared prefix pages once), and an int32 ``[B, n]`` block table into them.
        Syncs with the host (the page count); prefill steps are not graph-captured.
    """
    ps = k_cache.shape[1]
    b = block_table.shape[0]
    max_len = int(seq_lens.max()) if b else 0
    n = -(-max_len // ps)
    if n == 0:
        empty = torch.zeros((1, *k_cache.shape[1:]), dtype=dtype, device=k_cache.device)
        return empty, empty.clone(), torch.zeros((b, 1), dtype=torch.int32, device=block_table.device)
    bt = block_table[:, :n].clamp(0, k_cache.shape[0] - 1).long()
    # Unused tail entries may hold anything: point them at the row's first page so they add nothing.
    need = torch.arange(n, device=bt.device)[None, :] < ((seq_lens.long() + ps - 1) // ps)[:, None]
    bt = torch.where(need, bt, bt[:, :1])
    pages, inv = torch.unique(bt, return_inverse=True)
    k_tmp = dequantize_kv_ref(k_cache.index_select(0, pages), k_scale.index_select(0, pages), dtype)
    v_tmp = dequantize_kv_ref(v_cache.index_select(0, pages), v_scale.index_select(0, pages), dtype)
    return k_tmp, v_tmp, inv.to(torch.int32).view(b, n).contiguous()
