"""Multi-head latent attention (DeepSeek MLA) decode over a paged latent cache, in the absorbed form.

The cache holds one "KV head" per token, the latent ``[c_kv | k_pe]`` (``kv_lora_rank + rope_dim`` wide, 512 + 64
for DeepSeek-V2 / V3), and serves as both keys and values: query head h (its ``q_nope`` already multiplied by its
``W_UK`` slice, so ``q = [q_nope W_UK, q_pe]``) scores ``q . [c_kv | k_pe]`` and reads back ``softmax . c_kv``, the
first ``kv_lora_rank`` columns only (the caller multiplies them by ``W_UV``). Every query head attends over the one
latent head: multi-query attention with a 576-wide key and a 512-wide value that is a prefix of it.

The generic :func:`~infercore.ops.paged_attention_decode` computes the same with the cache passed as K and V, but its
Triton kernel reads each latent row twice (as K and as V), keeps all query heads of the KV head in one program
(128 for V3) and pads the head dim to a power of two (1024): past the GPU's shared memory and registers. The Triton
kernel here (``triton_mla.py``) reads each latent tile once for both products, splits the key and value widths
(512 + 64, no padding) and the query heads into blocks of 16, with split-K over the keys as flash-decoding does.
"""

from __future__ import annotations

import torch

from ...devices import dispatch, implementation, register
from .. import _validate as V
from . import cpu as _cpu  # noqa: F401  (registers the generic CPU decode used below)
from .naive import paged_attention_decode_ref

__all__ = ["paged_mla_decode", "paged_mla_decode_ref"]


def paged_mla_decode_ref(q, kv_cache, *, seq_lens, block_table, scale, kv_lora_rank) -> torch.Tensor:
    """Reference of :func:`paged_mla_decode`: the generic decode reference with the latent cache as keys and values,
    its first ``kv_lora_rank`` columns kept. Returns ``[B, H, kv_lora_rank]`` in ``q.dtype``."""
    return _sliced(paged_attention_decode_ref, q, kv_cache, seq_lens, block_table, scale, kv_lora_rank)


def _sliced(decode, q, kv_cache, seq_lens, block_table, scale, kv_lora_rank) -> torch.Tensor:
    o = decode(q, kv_cache, kv_cache, seq_lens=seq_lens, block_table=block_table, scale=scale)
    return o[..., :kv_lora_rank].contiguous()


def paged_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed-form MLA decode, one query token per sequence at position ``seq_lens[b] - 1``.

    Args:
        q: ``[B, H, kv_lora_rank + rope_dim]`` fp32/fp16/bf16: each head's latent query ``[q_nope W_UK | q_pe]``.
        kv_cache: ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]`` in q's dtype: ``[c_kv | k_pe]`` per token,
            this step's token already written.
        seq_lens: int32 ``[B]`` key counts including the current token (0: a padding row, zeros out).
        block_table: int32 ``[B, max_pages]``, as :func:`~infercore.ops.paged_attention_decode` takes it.
        scale: multiplier of the scores (DeepSeek: ``qk_head_dim ** -0.5``, times YaRN's mscale squared).
        kv_lora_rank: the value width, a prefix of the latent (512 for DeepSeek-V2 / V3).

    Returns:
        ``[B, H, kv_lora_rank]`` in ``q.dtype``: ``softmax(scale q . kv^T) kv[:, :kv_lora_rank]``, fp32 softmax.
    """
    op = "paged_mla_decode"
    V.floating(op, "q", q)
    V.ndim(op, "q", q, 3, "[batch, heads, kv_lora_rank + rope_dim]")
    V.floating(op, "kv_cache", kv_cache)
    V.ndim(op, "kv_cache", kv_cache, 4, "[num_pages, page_size, 1, kv_lora_rank + rope_dim]")
    V.dim_at_least_one(op, "kv_cache", kv_cache, 0, "num_pages")
    V.dim_at_least_one(op, "kv_cache", kv_cache, 1, "page_size")
    V.same_dtype(op, "kv_cache", kv_cache, "q", q)
    if kv_cache.shape[2] != 1:
        raise ValueError(f"{op}: kv_cache holds one latent head per token, got {kv_cache.shape[2]} heads")
    if kv_cache.shape[3] != q.shape[2]:
        raise ValueError(f"{op}: kv_cache width {kv_cache.shape[3]} != q width {q.shape[2]}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"{op}: kv_lora_rank must be an int in [1, {q.shape[2]}], got {kv_lora_rank!r}")
    V.integer(op, "seq_lens", seq_lens, (torch.int32,))
    V.ndim(op, "seq_lens", seq_lens, 1, "[batch]")
    V.integer(op, "block_table", block_table, (torch.int32,))
    V.ndim(op, "block_table", block_table, 2, "[batch, max_pages]")
    if seq_lens.shape[0] != q.shape[0] or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: seq_lens ({seq_lens.shape[0]}) and block_table ({block_table.shape[0]} rows) must "
                         f"have one entry per sequence of q ({q.shape[0]})")
    V.number(op, "scale", scale, positive=True)
    V.same_device(op, "q", q, kv_cache=kv_cache, seq_lens=seq_lens, block_table=block_table)
    return dispatch(op, q.device)(q, kv_cache, seq_lens=seq_lens, block_table=block_table, scale=float(scale),
                                  kv_lora_rank=kv_lora_rank)  # fmt: skip


def paged_mla_decode_cpu(q, kv_cache, *, seq_lens, block_table, scale, kv_lora_rank) -> torch.Tensor:
    """CPU: the generic CPU decode (native kernels / SDPA) with the latent cache as keys and values, sliced."""
    decode = implementation("paged_attention_decode", "cpu")
    return _sliced(decode, q, kv_cache, seq_lens, block_table, scale, kv_lora_rank)


register("paged_mla_decode", "reference", paged_mla_decode_ref)
register("paged_mla_decode", "cpu", paged_mla_decode_cpu, priority=5, available=lambda cap: cap.device_type == "cpu")
