"""CPU fast path of RoPE fused with the KV-cache write (neox style, full rotary): q and k rotate
together in one pass of elementwise ops, and the write is one ``index_copy_`` per cache. fp32 / bf16 tensors with
caches of their dtype, or int8 / float8_e4m3fn caches with their scales (quantized in the kernel, bit for bit as the
reference), go through the native kernel (``ops.moe.cpu_native``) where it builds, skipped slots (-1) included.
Other variants (interleaved, partial rotary; skipped slots off the native path) take the reference."""

from __future__ import annotations

import torch

from ...devices import implementation, register
from ..moe import cpu_native


def rope_and_write_kv_cpu(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, is_neox=True,
                          k_scale=None, v_scale=None):
    T, hq, d = q.shape
    rd = cos_sin_cache.shape[-1]
    if k_scale is not None:  # int8 / float8_e4m3fn codes: the native kernel quantizes the rows as the reference does
        if (is_neox and rd == d and T and cpu_native.layer_ops_apply(q, k, v)  # fp32 / bf16 rows, the library built
                and cos_sin_cache.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
                and k_cache.dtype in (torch.int8, torch.float8_e4m3fn) and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:] and v.shape == k.shape
                and v_cache.shape == k_cache.shape and k_scale.shape == v_scale.shape == k_cache.shape[:3]
                and k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.is_contiguous()
                and v_scale.is_contiguous() and positions.shape[0] == T == slot_mapping.shape[0]):
            return cpu_native.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                            k_scale, v_scale)
        ref = implementation("rope_and_write_kv", "reference")
        return ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=is_neox,
                   k_scale=k_scale, v_scale=v_scale)
    if (is_neox and rd == d and T and cpu_native.layer_ops_apply(q, k, v, k_cache, v_cache)
            and cos_sin_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[2:] == k.shape[1:] and v.shape == k.shape and v_cache.shape == k_cache.shape
            and positions.shape[0] == T == slot_mapping.shape[0]):  # slot -1 (not stored) included
        return cpu_native.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if not is_neox or rd != d or int(slot_mapping.min()) < 0:
        ref = implementation("rope_and_write_kv", "reference")
        return ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=is_neox)
    half = d // 2
    cs = cos_sin_cache[positions.long()].float()  # [T, rd] = [cos | sin]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = torch.cat([q, k], dim=1).float()  # [T, Hq + Hk, D]
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)
    num_pages, page_size, hk, _ = k_cache.shape
    slots = slot_mapping.long()
    k_cache.view(num_pages * page_size, hk, d).index_copy_(0, slots, rot[:, hq:].to(k_cache.dtype))
    v_cache.view(num_pages * page_size, hk, d).index_copy_(0, slots, v.to(v_cache.dtype))
    return rot[:, :hq]


register("rope_and_write_kv", "cpu", rope_and_write_kv_cpu, priority=5, available=lambda cap: cap.device_type == "cpu")
