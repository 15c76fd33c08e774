"""Pure-PyTorch paged attention.

This is both the specification for the Triton kernels and the CPU engine's production path, so it
avoids per-token Python loops: decode gathers every sequence's pages at once and runs batched
matmuls; prefill loops over sequences (a handful per step) and attends each one in a single call.

GQA never materializes repeated K/V: in prefill q ``[T, Hq, D]`` is regrouped as ``[Hk, group * T, D]``
so each KV head meets all of its query heads in one call; decode runs one batched matmul per KV head
on strided views of the gathered pages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[num_pages, page_size, *rest]``, ``pages[..., n]`` -> fresh ``[..., n * page_size, *rest]``.

    Gathers whole pages (one contiguous row of ``page_size * Hk * D`` elements each) with index_select,
    a plain row copy on the CPU. Also gathers scale caches ``[num_pages, page_size, Hk]``.
    """
    flat = cache.reshape(cache.shape[0], -1)
    g = flat.index_select(0, pages.reshape(-1).long())
    return g.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``q[..., Hk, M, D]``, ``k/v[..., Hk, L, D]``, bool ``mask[..., M, L]`` (True = visible);
    ``sinks`` fp32 ``[..., Hk, M]``: each row's sink logit, one more term of the softmax's denominator."""
    mask = mask.unsqueeze(-3)  # broadcast over KV heads
    if sinks is not None:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(torch.cat([s, sinks.unsqueeze(-1)], dim=-1), dim=-1)[..., :-1]
        out = torch.matmul(p, v)
    elif softcap is None:
        # SDPA's fused CPU kernel avoids materializing the [M, L] score matrix; it takes the same
        # boolean mask (True = attend) and computes in fp32 for fp32 inputs.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v)
    # A row with no visible key (e.g. a zero-length padded sequence) has no defined softmax: emit zeros
    # instead of NaN so padding never poisons later layers.
    return torch.where(mask.any(-1, keepdim=True), out, 0.0)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (+ window) mask: query at position i sees key j iff ``i - w < j <= i``."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    m = kp <= qp
    if window is not None:
        m &= kp > qp - window
    return m


def paged_attention_decode_ref(
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`~infercore.ops.paged_attention_decode`: q ``[B, Hq, D]``, caches
    ``[num_pages, page_size, Hk, D]`` (float, or int8/fp8 codes with fp32 ``k_scale``/``v_scale``
    ``[num_pages, page_size, Hk]``), int32 ``seq_lens [B]`` and ``block_table [B, max_pages]``, optional
    fp32 ``sinks [Hq]`` (a per-head logit in each softmax's denominator, no value).
    Returns ``[B, Hq, D]`` in ``q.dtype`` (fp32 softmax; zeros for a zero-length sequence)."""
    b, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    if b == 0:
        return q.new_empty(q.shape)
    max_len = int(seq_lens.max())
    if max_len <= 0:
        return torch.zeros_like(q)
    n_pages = -(-max_len // page_size)
    # Entries past a sequence's own pages may hold anything (padding): clamp to a valid page id and
    # let the mask hide them.
    pages = block_table[:, :n_pages].clamp(0, k_cache.shape[0] - 1)
    keys = _gather_pages(k_cache, pages).float()  # [B, L, Hk, D]
    vals = _gather_pages(v_cache, pages).float()
    if k_scale is not None:
        # int8 / fp8 codes: value = code * scale[token, head] (ops/kv_cache/quant.py)
        keys *= _gather_pages(k_scale, pages).unsqueeze(-1)
        vals *= _gather_pages(v_scale, pages).unsqueeze(-1)
    L = keys.shape[1]
    seq = seq_lens.long().view(b, 1)
    k_pos = torch.arange(L, device=q.device).view(1, L)
    valid = k_pos < seq
    if sliding_window is not None:
        valid &= k_pos > seq - 1 - sliding_window
    # Slots past a sequence's end may be uninitialized memory (NaN/inf). Scores are masked by
    # replacement (masked_fill), which also removes NaN; V must be zeroed since 0 * NaN leaks
    # through P @ V. Only the tails need it (keys outside the window are real data), and `vals`
    # is our own copy, so zero them in place.
    for row, n in enumerate(seq_lens.tolist()):
        if n < L:
            vals[row, max(n, 0) :] = 0.0
    qg = q.float().view(b, hk, group, d)  # heads h = kv_head * group + g, matching HF's repeat_kv
    # One batched matmul per KV head on strided views of the gathered [B, L, Hk, D] pages: BLAS takes
    # the head stride as its leading dimension, whereas a head-major permute would copy all of K and V.
    s = torch.stack([torch.matmul(qg[:, h], keys[:, :, h].transpose(1, 2)) for h in range(hk)], dim=1)
    s = s * scale  # [B, Hk, G, L]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s.masked_fill_(~valid.view(b, 1, 1, L), float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        sink = sinks.float().view(1, hk, group, 1).expand(b, hk, group, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :L]
    out = torch.stack([torch.matmul(p[:, h], vals[:, :, h]) for h in range(hk)], dim=1)  # [B, Hk, G, D]
    # seq_len 0 (batch padding) has no visible key: zeros, not NaN.
    out = torch.where((seq > 0).view(b, 1, 1, 1), out, 0.0)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_attention_prefill_ref(
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
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`~infercore.ops.paged_attention_prefill` (float caches): q ``[T, Hq, D]`` ragged
    by int32 ``cu_seqlens_q [B+1]``, caches ``[num_pages, page_size, Hk, D]``, int32 ``seq_lens [B]`` and
    ``block_table [B, max_pages]``, optional fp32 ``sinks [Hq]`` (per-head softmax sink logits).
    ``k``/``v`` ``[T, Hk, D]`` (ragged like q), when given, supply the
    keys/values of each sequence's own query positions; then only the cached prefix is read from the
    pages. Returns ``[T, Hq, D]`` in ``q.dtype`` (fp32 softmax). Raises ValueError when a sequence has
    more queries than ``seq_lens`` keys."""
    del max_seqlen_q  # a launch-size hint for kernels; the reference reads the lengths directly
    t, hq, d = q.shape
    page_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"paged_attention_prefill: sequence {b} has {q_len} queries but seq_lens {seq_len}")
        first_q = seq_len - q_len  # queries are the last q_len positions (the rest is cached prefix)
        # With a window, keys before first_q - w + 1 are invisible to every query: skip their pages.
        first_page = 0 if sliding_window is None else max(0, first_q - sliding_window + 1) // page_size
        cached_end = seq_len if k is None else first_q  # keys read from the pages: [k_off, cached_end)
        k_off = min(first_page * page_size, cached_end)
        pages = block_table[b, k_off // page_size : -(-cached_end // page_size)]
        keys = _gather_pages(k_cache, pages)[: cached_end - k_off].float().transpose(0, 1)  # [Hk, L, D]
        vals = _gather_pages(v_cache, pages)[: cached_end - k_off].float().transpose(0, 1)
        if k is not None:
            keys = torch.cat([keys, k[q0:q1].float().transpose(0, 1)], dim=1)
            vals = torch.cat([vals, v[q0:q1].float().transpose(0, 1)], dim=1)
        q_pos = torch.arange(first_q, seq_len, device=q.device)
        k_pos = torch.arange(k_off, seq_len, device=q.device)
        mask = _visible(q_pos, k_pos, sliding_window)  # [q_len, L]; every key lies below seq_len
        # [q_len, Hq, D] -> [Hk, group * q_len, D]; the mask repeats once per query head of the group.
        qg = q[q0:q1].float().view(q_len, hk, group, d).permute(1, 2, 0, 3).reshape(hk, group * q_len, d)
        sink = None if sinks is None else sinks.float().view(hk, group, 1).expand(hk, group, q_len).reshape(hk, -1)
        o = _attend(qg, keys, vals, mask.repeat(group, 1), scale=scale, softcap=softcap, sinks=sink)
        out[q0:q1] = o.view(hk, group, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d).to(q.dtype)
    return out
