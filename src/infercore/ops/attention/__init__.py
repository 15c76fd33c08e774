"""Causal attention over a paged KV cache (prefill with cached prefixes, and decode)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ...devices import accepts, dispatch, implementation, register
from .. import _validate as V
from ..kv_cache import dequantize_paged_kv, is_quantized_kv, scale_aware
from ..kv_cache.quant import check_kv_scales
from ..rope.fused import check_rope_write_args
from .metadata import AttentionMetadata
from .naive import paged_attention_decode_ref, paged_attention_prefill_ref
from .scores import attention_with_key_scores, select_kv_tokens

__all__ = ["AttentionMetadata", "attention_with_key_scores", "paged_attention", "paged_attention_decode",
           "paged_attention_prefill", "select_kv_tokens", "split_decodes"]

_I32 = (torch.int32,)


def _check_common(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    V.floating(op, "q", q)
    V.ndim(op, "q", q, 3, "[tokens, q_heads, head_dim]")
    V.tensor(op, "k_cache", k_cache)
    if not is_quantized_kv(k_cache.dtype):
        V.floating(op, "k_cache", k_cache)
    V.ndim(op, "k_cache", k_cache, 4, "[num_pages, page_size, kv_heads, head_dim]")
    V.dim_at_least_one(op, "k_cache", k_cache, 0, "num_pages")
    V.dim_at_least_one(op, "k_cache", k_cache, 1, "page_size")
    V.tensor(op, "v_cache", v_cache)
    V.same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"{op}: k_cache head_dim {k_cache.shape[3]} != q head_dim {d}")
    if hk == 0 or hq % hk:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k_cache kv heads ({hk})")
    V.integer(op, "seq_lens", seq_lens, _I32)
    V.ndim(op, "seq_lens", seq_lens, 1, "[batch]")
    V.integer(op, "block_table", block_table, _I32)
    V.ndim(op, "block_table", block_table, 2, "[batch, max_pages]")
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"{op}: block_table has {block_table.shape[0]} rows but seq_lens has {seq_lens.shape[0]} sequences"
        )
    V.number(op, "scale", scale, positive=True)
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
    ):
        raise ValueError(f"{op}: sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None:
        V.number(op, "softcap", softcap, positive=True)
    V.same_device(op, "q", q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_table=block_table)


def _check_sinks(op: str, q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if sinks is None:
        return
    V.floating(op, "sinks", sinks, (torch.float32,))
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{op}: sinks has shape {tuple(sinks.shape)}, expected [q_heads] = ({q.shape[1]},)")
    V.same_device(op, "q", q, sinks=sinks)


def sinks_kw(op: str, fn: Callable, sinks: torch.Tensor | None) -> dict:
    """``{"sinks": sinks}`` for an implementation ``fn`` of ``op`` that takes them, ``{}`` when ``sinks`` is None
    (nothing changes for models without sinks); ValueError naming ``fn`` when it takes none (its result would
    leave the sinks out)."""
    if sinks is None:
        return {}
    if not accepts(fn, "sinks"):
        raise ValueError(f"{op}: the implementation {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)} "
                         "takes no attention sinks; force another backend (INFERCORE_BACKEND) for this model")
    return {"sinks": sinks}


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    only_seqs: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a ragged batch of query chunks against their paged KV.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16, sequences concatenated (tokens first).
        k_cache, v_cache: ``[num_pages, page_size, Hk, D]``; this step's K/V must already be written
            (see :func:`write_kv_cache_`). ``Hq % Hk == 0`` (GQA: query head h uses KV head ``h // (Hq/Hk)``).
        cu_seqlens_q: int32 ``[B+1]``; sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q.
        seq_lens: int32 ``[B]``, total KV length of each sequence *including* this step's queries;
            the queries of sequence b sit at positions ``seq_lens[b] - q_len_b ... seq_lens[b] - 1``
            (everything before is a cached prefix).
        block_table: int32 ``[B, max_pages]``; token j of sequence b is at
            ``cache[block_table[b, j // page_size], j % page_size]``.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        sliding_window: HF semantics, query i sees key j iff ``i - w < j <= i``; None = full causal.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2); None = off.
        max_seqlen_q: optional host-side upper bound of the query lengths (a launch hint for kernels).
        k_scale, v_scale: fp32 ``[num_pages, page_size, Hk]``, required exactly when the caches are
            int8 / float8_e4m3fn (``ops/kv_cache/quant.py``). The prefill kernels read float caches
            only, so the pages this batch reads are first dequantized into a temporary cache in
            ``q.dtype`` (:func:`~infercore.ops.kv_cache.dequantize_paged_kv`; one host sync).
        k, v: optional ``[T, Hk, D]`` in ``q.dtype``, ragged like q: this step's new keys/values (the
            values just written into the cache, before any cache quantization). When given, the new
            positions' keys/values are taken from them and only the cached prefix is read through the
            block table, as FlashAttention varlen / FlashInfer ragged prefill do (the GPU kernel then
            reads contiguous rows instead of page gathers; with a quantized cache the new tokens attend
            unquantized). Implementations that cannot take them read the cache instead when it holds the
            same values, else the reference runs.
        only_seqs: int32 ``[S]``, the sequences whose queries are needed; the result's other rows
            may be left unwritten (an implementation that takes the argument computes these alone;
            others compute everything). For a caller that runs a mixed step's decodes through
            :func:`paged_attention_decode` (see :func:`split_decodes`).
        sinks: optional fp32 ``[Hq]`` attention sinks (GPT-OSS): head h's softmax denominator gets one more
            term ``exp(sinks[h])`` (a logit with no value), so ``o = sum_j e^{s_j} v_j / (e^{sinks[h]} +
            sum_j e^{s_j})``. None: plain softmax (the implementations see no extra argument).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``; softmax in fp32.
    """
    op = "paged_attention_prefill"
    _check_common(op, q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window, softcap)
    V.integer(op, "cu_seqlens_q", cu_seqlens_q, _I32)
    V.ndim(op, "cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"{op}: cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected len(seq_lens) + 1 = "
            f"{seq_lens.shape[0] + 1}"
        )
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int)):
        raise TypeError(f"{op}: max_seqlen_q must be an int or None, got {type(max_seqlen_q).__name__}")
    V.same_device(op, "q", q, cu_seqlens_q=cu_seqlens_q)
    if only_seqs is not None:
        V.integer(op, "only_seqs", only_seqs, _I32)
        V.ndim(op, "only_seqs", only_seqs, 1, "[num_selected_sequences]")
        V.same_device(op, "q", q, only_seqs=only_seqs)
    _check_new_kv(op, q, k_cache, k, v)
    _check_sinks(op, q, sinks)
    quantized = check_kv_scales(op, k_cache, v_cache, k_scale, v_scale)
    fn = prefill_impl(q.device, new_kv=k is not None, cache_holds_new_kv=not quantized and k_cache.dtype == q.dtype)
    if quantized:
        k_cache, v_cache, block_table = dequantize_paged_kv(
            k_cache, v_cache, k_scale, v_scale, block_table=block_table, seq_lens=seq_lens, dtype=q.dtype)
    new_kv = {"k": k, "v": v} if k is not None and takes_new_kv(fn) else {}
    if only_seqs is not None and accepts(fn, "only_seqs"):
        new_kv["only_seqs"] = only_seqs
    new_kv.update(sinks_kw(op, fn, sinks))
    return fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_table=block_table,
        scale=float(scale),
        sliding_window=sliding_window,
        softcap=None if softcap is None else float(softcap),
        max_seqlen_q=max_seqlen_q,
        **new_kv,
    )


def _check_new_kv(op: str, q: torch.Tensor, k_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None):
    if (k is None) != (v is None):
        raise ValueError(f"{op}: pass both k and v (this step's new keys/values) or neither")
    if k is None:
        return
    want = (q.shape[0], k_cache.shape[2], q.shape[2])
    for name, t in (("k", k), ("v", v)):
        V.floating(op, name, t)
        V.ndim(op, name, t, 3, "[tokens, kv_heads, head_dim]")
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected [T, Hk, D] = {want} (ragged like q)")
        V.same_dtype(op, name, t, "q", q)
        V.same_device(op, "q", q, **{name: t})


def takes_new_kv(fn: Callable) -> bool:
    """Whether a prefill implementation accepts the new tokens' ``k`` / ``v`` ``[T, Hk, D]`` directly
    (read contiguously instead of through the block table)."""
    return accepts(fn, "k")


# Mixed steps (prefill chunks and decodes together): from this many one-query sequences on, the engine's
# runner asks for them to go through the decode kernel (AttentionMetadata.num_split_decodes) and for
# the prefill kernel's grid to cover the other sequences only. In the prefill kernel each of them took
# a whole BLOCK_M-row query tile per query head for one valid row (the decode kernel packs a KV head's
# query heads into one program), and the grid, ``max_seqlen_q / BLOCK_M`` tiles per sequence and head,
# mostly programs that exit at once. 8B shape, decodes at ~1k context plus a 2048-token prompt
# (results/h200/mixed_step.json): 16 decodes 55.7 -> 52.2 ms, 64 decodes 73.3 -> 52.9, 256 131.5 -> 64.1;
# 4 decodes 51.8 -> 52.1 (and 50.5 -> 49.8 in an earlier run): within the noise, hence from 8.
# INFERCORE_SPLIT_DECODES_MIN overrides it (a huge value turns the split off).
SPLIT_DECODES_MIN = int(os.environ.get("INFERCORE_SPLIT_DECODES_MIN", "8"))
if SPLIT_DECODES_MIN < 1:
    raise ValueError(f"INFERCORE_SPLIT_DECODES_MIN: expected a positive int, got {SPLIT_DECODES_MIN}")


def split_decodes(meta: AttentionMetadata, prefill_fn: Callable) -> bool:
    """Whether a mixed step's one-query sequences (``meta.num_split_decodes``) run through the decode
    kernel, the prefill implementation ``prefill_fn`` leaving them out (:func:`attend_split_decodes`)."""
    return meta.num_split_decodes > 0 and not meta.decode_only and accepts(prefill_fn, "only_seqs")


def attend_split_decodes(o: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, decode_fn: Callable, **kw) -> torch.Tensor:
    """Fill the rows of ``o`` (``[T, Hq, D]``, written by a prefill that skipped its one-query sequences)
    that belong to ``meta``'s split decodes with ``decode_fn(q_rows, k_cache, v_cache, seq_lens=,
    block_table=, **kw)``. Those sequences' new K/V must be in the cache already. Returns ``o``."""
    n = meta.num_split_decodes
    if meta.decode_seqs is None:  # the batch's first n sequences, rows 0 .. n - 1
        o[:n] = decode_fn(q[:n], k_cache, v_cache, seq_lens=meta.seq_lens[:n], block_table=meta.block_table[:n],
                          **kw)  # fmt: skip
        return o
    rows, seqs = meta.decode_tokens, meta.decode_seqs
    od = decode_fn(q.index_select(0, rows), k_cache, v_cache, seq_lens=meta.seq_lens.index_select(0, seqs),
                   block_table=meta.block_table.index_select(0, seqs), **kw)  # fmt: skip
    return o.index_copy_(0, rows, od)


def prefill_impl(device: torch.device | str, *, new_kv: bool, cache_holds_new_kv: bool) -> Callable:
    """The ``paged_attention_prefill`` implementation to call with (``new_kv``) or without this step's
    contiguous k/v. One that cannot take them is still right when the cache holds the same values
    (``cache_holds_new_kv``: a float cache of k's dtype), the caller then drops k/v; otherwise (a
    quantized cache, whose new tokens would read as quantized) the reference runs. Callers pass
    ``k=``/``v=`` only when :func:`takes_new_kv` says the returned function accepts them."""
    fn = dispatch("paged_attention_prefill", device)
    if new_kv and not cache_holds_new_kv and not takes_new_kv(fn):
        return implementation("paged_attention_prefill", "reference")
    return fn



def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    shared_seqs: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (at position ``seq_lens[b] - 1``) against its paged KV.

    Args:
        q: ``[B, Hq, D]`` fp32/fp16/bf16.
        k_cache, v_cache, block_table, scale, sliding_window, softcap, sinks: as in
            :func:`paged_attention_prefill`.
        k_scale, v_scale: fp32 ``[num_pages, page_size, Hk]`` for int8 / float8_e4m3fn caches; the
            kernels read the 1-byte codes and dequantize in registers (no temporary cache).
        seq_lens: int32 ``[B]`` KV lengths including the current token; a sequence with length 0
            (batch padding) yields zeros.
        shared_seqs: rows may be consecutive positions of one sequence (their keys all written before
            this call; :attr:`AttentionMetadata.shared_seqs`): passed to implementations that read part of
            the cache ahead of the previous kernel's end (the Triton kernel under PDL), which then do not.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``; softmax in fp32.
    """
    op = "paged_attention_decode"
    _check_common(op, q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window, softcap)
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: seq_lens has {seq_lens.shape[0]} entries but q has {q.shape[0]} sequences")
    _check_sinks(op, q, sinks)
    quantized = check_kv_scales(op, k_cache, v_cache, k_scale, v_scale)
    fn, extra = decode_impl(q.device, quantized=quantized, shared_seqs=shared_seqs)
    if quantized:
        extra.update(k_scale=k_scale, v_scale=v_scale)
    extra.update(sinks_kw(op, fn, sinks))
    return fn(q, k_cache, v_cache, seq_lens=seq_lens, block_table=block_table, scale=float(scale),
              sliding_window=sliding_window, softcap=None if softcap is None else float(softcap), **extra)


def decode_impl(device: torch.device | str, *, quantized: bool, shared_seqs: bool) -> tuple[Callable, dict]:
    """The ``paged_attention_decode`` implementation for ``device`` (one that reads 1-byte caches' scales when
    ``quantized``) and the optional keywords to pass it: ``shared_seqs=True`` where asked and accepted."""
    op = "paged_attention_decode"
    fn = scale_aware(op, device) if quantized else dispatch(op, device)
    return fn, ({"shared_seqs": True} if shared_seqs and accepts(fn, "shared_seqs") else {})


def rope_write_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_neox: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode with the new token's RoPE and KV write folded in: ``rope_and_write_kv_cache_`` on the
    un-rotated q ``[B, Hq, D]`` and k / v ``[B, Hk, D]`` (``positions``, ``slot_mapping`` ``[B]``), then
    :func:`paged_attention_decode` (the other arguments as there). On CUDA one kernel does both (the
    RoPE / KV-write launch is gone); float caches only; ``sinks`` fp32 ``[Hq]`` as there. Returns ``[B, Hq, D]`` in
    ``q.dtype``."""
    op = "rope_write_decode_attention"
    _check_common(op, q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window, softcap)
    _check_sinks(op, q, sinks)
    check_rope_write_args(op, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if is_quantized_kv(k_cache.dtype):
        raise ValueError(f"{op}: k_cache: a quantized ({k_cache.dtype}) cache takes the unfused ops")
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: seq_lens has {seq_lens.shape[0]} entries but q has {q.shape[0]} sequences")
    fn = dispatch(op, q.device)
    return fn(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, seq_lens=seq_lens,
        block_table=block_table, scale=float(scale), sliding_window=sliding_window,
        softcap=None if softcap is None else float(softcap), is_neox=V.flag(op, "is_neox", is_neox),
        **sinks_kw(op, fn, sinks))  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention driven by the step's :class:`AttentionMetadata`.

    ``q`` is ``[T, Hq, D]``; uses :func:`paged_attention_decode` when ``meta.decode_only`` (then
    ``T == B``) and :func:`paged_attention_prefill` otherwise, with ``meta.num_split_decodes`` one-query
    sequences of a mixed step through the decode kernel where the prefill one can leave them out.
    ``k_scale``/``v_scale`` as there (quantized caches); ``k``/``v`` (this step's new K/V, optional) go to
    prefill only; ``sinks`` (fp32 ``[Hq]``, optional) to both. Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"paged_attention: meta must be an AttentionMetadata, got {type(meta).__name__}")
    if meta.decode_only:
        return paged_attention_decode(
            q,
            k_cache,
            v_cache,
            seq_lens=meta.seq_lens,
            block_table=meta.block_table,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            shared_seqs=meta.shared_seqs,
            sinks=sinks,
        )
    split = split_decodes(meta, dispatch("paged_attention_prefill", q.device))
    o = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens=meta.seq_lens,
        block_table=meta.block_table,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        max_seqlen_q=meta.max_seqlen_q,
        k_scale=k_scale,
        v_scale=v_scale,
        k=k,
        v=v,
        only_seqs=meta.prefill_seqs if split else None,
        sinks=sinks,
    )
    if split:
        attend_split_decodes(o, q, k_cache, v_cache, meta, paged_attention_decode, scale=scale,
                             sliding_window=sliding_window, softcap=softcap, k_scale=k_scale,
                             v_scale=v_scale, sinks=sinks)  # fmt: skip
    return o


def rope_write_decode_attention_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, seq_lens,
                                    block_table, scale, sliding_window=None, softcap=None, is_neox=True,
                                    sinks=None):  # fmt: skip
    """Reference of ``rope_write_decode_attention`` (the fused decode kernel in ``triton_decode``): the
    ``rope_and_write_kv`` reference (rotates q / k, writes the rotated k and v into the cache), then
    the decode-attention reference."""
    q_rot = implementation("rope_and_write_kv", "reference")(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                                             slot_mapping, is_neox=is_neox)  # fmt: skip
    return paged_attention_decode_ref(q_rot, k_cache, v_cache, seq_lens=seq_lens, block_table=block_table,
                                      scale=scale, sliding_window=sliding_window, softcap=softcap,
                                      sinks=sinks)  # fmt: skip


register("paged_attention_prefill", "reference", paged_attention_prefill_ref)
register("paged_attention_decode", "reference", paged_attention_decode_ref)
register("rope_write_decode_attention", "reference", rope_write_decode_attention_ref)
