"""``rope_and_write_kv_cache_``: RoPE on q/k fused with the paged KV-cache write.

The reference is the composition of the two reference ops (``apply_rope`` then
``write_kv_cache_``); fast implementations (``ops/rope/triton.py``) register against the op name
``"rope_and_write_kv"``. Layouts are those of the two ops it fuses.
"""

from __future__ import annotations

import torch

from infercore.devices import dispatch, implementation, register

from .. import _validate as V
from ..kv_cache import scale_aware
from ..kv_cache.quant import check_kv_scales, is_quantized_kv


def rope_and_write_kv_cache_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_k: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The composition of the reference ops. ``return_k`` (implementations that take it): return the rotated k
    as well, ``(q_rot, k_rot)``, for a prefill that reads this step's K/V from contiguous tensors."""
    # Looked up at call time: the reference ops register when their packages are imported.
    q_rot, k_rot = implementation("apply_rope", "reference")(q, k, positions, cos_sin_cache, is_neox=is_neox)
    write = implementation("write_kv_cache_", "reference")
    if k_scale is None:
        write(k_rot, v, k_cache, v_cache, slot_mapping)
    else:
        write(k_rot, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return (q_rot, k_rot) if return_k else q_rot


def check_rope_write_args(op: str, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
    """The argument checks of :func:`rope_and_write_kv_cache_` (layouts in its docstring), raising
    ``TypeError`` / ``ValueError`` that name ``op`` and the argument; shared with the decode op that
    folds the same RoPE and KV write in (``ops.attention.rope_write_decode_attention``)."""
    V.floating(op, "q", q)
    V.ndim(op, "q", q, 3, "[tokens, q_heads, head_dim]")
    V.floating(op, "k", k)
    V.ndim(op, "k", k, 3, "[tokens, kv_heads, head_dim]")
    V.same_dtype(op, "k", k, "q", q)
    V.floating(op, "v", v)
    V.same_dtype(op, "v", v, "k", k)
    if v.shape != k.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)}, incompatible with q {tuple(q.shape)}")
    V.tensor(op, "k_cache", k_cache)
    V.tensor(op, "v_cache", v_cache)
    if not (k_cache.is_floating_point() or is_quantized_kv(k_cache.dtype)):
        raise TypeError(f"{op}: k_cache must be a floating, int8 or float8_e4m3fn tensor, got {k_cache.dtype}")
    V.ndim(op, "k_cache", k_cache, 4, "[num_pages, page_size, kv_heads, head_dim]")
    V.dim_at_least_one(op, "k_cache", k_cache, 0, "num_pages")
    V.dim_at_least_one(op, "k_cache", k_cache, 1, "page_size")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"{op}: k_cache heads/head_dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) must match k_cache "
                         f"({tuple(k_cache.shape)}, {k_cache.dtype})")  # fmt: skip
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    V.integer(op, "positions", positions)
    V.ndim(op, "positions", positions, 1, "[tokens]")
    V.integer(op, "slot_mapping", slot_mapping, (torch.int32,))
    V.ndim(op, "slot_mapping", slot_mapping, 1, "[tokens]")
    if positions.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(f"{op}: positions ({positions.shape[0]}) and slot_mapping ({slot_mapping.shape[0]}) "
                         f"must have one entry per token ({T})")  # fmt: skip
    V.floating(op, "cos_sin_cache", cos_sin_cache)
    V.ndim(op, "cos_sin_cache", cos_sin_cache, 2, "[max_positions, rotary_dim]")
    rd = cos_sin_cache.shape[-1]
    if rd % 2 or rd > D or rd == 0:
        raise ValueError(f"{op}: cos_sin_cache rotary_dim {rd} must be even and <= head_dim {D}")
    V.same_device(op, "q", q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, positions=positions,
                  slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache)  # fmt: skip


def rope_and_write_kv_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q/k by RoPE and write the rotated k and v into the paged caches in place.

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (one dtype), ``positions`` int32/int64 ``[T]``,
    ``cos_sin_cache`` ``[max_positions, rotary_dim]`` (cos | sin halves), caches
    ``[num_pages, page_size, Hk, D]``, ``slot_mapping`` int32 ``[T]`` (``-1`` = skip the write).
    int8 / float8_e4m3fn caches take fp32 ``k_scale``/``v_scale`` ``[num_pages, page_size, Hk]`` and
    are quantized on write (the rotated k is rounded to k's dtype first, as the unfused ops would).
    Returns the rotated q ``[T, Hq, D]`` (a new tensor).
    """
    op = "rope_and_write_kv_cache_"
    check_rope_write_args(op, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    is_neox = V.flag(op, "is_neox", is_neox)
    if check_kv_scales(op, k_cache, v_cache, k_scale, v_scale):
        fn = scale_aware("rope_and_write_kv", q.device)
        return fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=is_neox,
                  k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    fn = dispatch("rope_and_write_kv", q.device)
    return fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=is_neox)


register("rope_and_write_kv", "reference", rope_and_write_kv_cache_reference)
