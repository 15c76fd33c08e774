"""``rope_and_write_kv_cache_``: RoPE on q/k fused with the paged KV-cache write.

The reference is the composition of the two reference ops (``apply_rope`` then
``write_kv_cache_``); fast implementations (``ops/rope/triton.py``) register against the op name
``"rope_and_write_kv"``. Layouts are those of the two ops it fuses.
"""

from __future__ import annotations

import torch

from infercore.devices import dispatch, implementation, register


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
) -> torch.Tensor:
    # Looked up at call time: the reference ops register when their packages are imported.
    q_rot, k_rot = implementation("apply_rope", "reference")(q, k, positions, cos_sin_cache, is_neox=is_neox)
    implementation("write_kv_cache_", "reference")(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


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
) -> torch.Tensor:
    """Rotate q/k by RoPE and write the rotated k and v into the paged caches in place.

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (one dtype), ``positions`` int32/int64 ``[T]``,
    ``cos_sin_cache`` ``[max_positions, rotary_dim]`` (cos | sin halves), caches
    ``[num_pages, page_size, Hk, D]``, ``slot_mapping`` int32 ``[T]`` (``-1`` = skip the write).
    Returns the rotated q ``[T, Hq, D]`` (a new tensor).
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q/k/v: expected [T, H, D] with v.shape == k.shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k: expected [{T}, Hk, {D}], got {tuple(k.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache: expected [P, page_size, {k.shape[1]}, {D}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")  # fmt: skip
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions: expected int32/int64 [{T}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping: expected int32 [{T}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > D:
        raise ValueError(f"cos_sin_cache: expected [max_positions, rotary_dim] with even rotary_dim <= {D}, "
                         f"got {tuple(cos_sin_cache.shape)}")  # fmt: skip
    fn = dispatch("rope_and_write_kv", q.device)
    return fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=is_neox)


register("rope_and_write_kv", "reference", rope_and_write_kv_cache_reference)
