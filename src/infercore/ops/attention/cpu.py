"""CPU fast path of paged attention: per sequence, gather only the pages its (windowed) context
touches and run ATen's fused CPU attention (``scaled_dot_product_attention`` with GQA) on them.

The reference materializes scores for the whole padded batch; on the CPU the engine mostly runs
one or a few sequences, where a per-sequence loop over a fused kernel is the cheap shape. Softcap
is not expressible in SDPA, so softcapped layers take the reference. Decode over fp32 / bf16 caches of q's dtype,
and over int8 / fp8 code caches with their scales, goes through the native kernel (``ops.moe.cpu_native``: fp32
scores, softmax and sum per KV head) where it builds.

Attention sinks (``sinks [Hq]``, GPT-OSS) are expressible in SDPA: a zero key (score 0) with a zero value, whose
column of a float mask holds each head's sink logit (``_with_sinks``), in fp32. The native kernel takes no sinks, so
decode with sinks runs the SDPA loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...devices import implementation, register
from ..moe import cpu_native


def _context(k_cache, v_cache, pages_row, start: int, end: int):
    """K/V of key positions [start, end) of one sequence, as [1, Hk, L, D] views (scale caches
    ``[P, page_size, Hk]`` give ``[1, Hk, L]``)."""
    ps = k_cache.shape[1]
    p0, p1 = start // ps, -(-end // ps)
    pages = pages_row[p0:p1]
    off = start - p0 * ps
    k = k_cache.index_select(0, pages).flatten(0, 1)[off : off + end - start]
    v = v_cache.index_select(0, pages).flatten(0, 1)[off : off + end - start]
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def _with_sinks(k, v, mask, sinks):
    """fp32 ``k``/``v`` ``[1, Hk, L, D]`` and a bool ``mask`` broadcastable to ``[1, 1, M, L]`` (None: all visible)
    -> ``(k, v, float mask [1, Hq, M, L + 1])`` whose extra key scores ``sinks[h]`` and adds nothing to the
    output: softmax with the sink in its denominator, through SDPA."""
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    L = k.shape[2] - 1
    m = mask if mask is not None else torch.ones(1, 1, 1, L, dtype=torch.bool, device=k.device)
    m = m.reshape(1, 1, -1, L)
    add = torch.zeros(1, sinks.shape[0], m.shape[2], L + 1, dtype=torch.float32, device=k.device)
    add[..., :L].masked_fill_(~m, float("-inf"))
    add[..., L] = sinks.float().view(-1, 1)
    return k, v, add


def paged_attention_decode_cpu(q, k_cache, v_cache, *, seq_lens, block_table, scale, sliding_window=None,
                               softcap=None, k_scale=None, v_scale=None, sinks=None):
    if softcap is not None:
        kw = {} if sinks is None else {"sinks": sinks}
        return implementation("paged_attention_decode", "reference")(
            q, k_cache, v_cache, seq_lens=seq_lens, block_table=block_table, scale=scale,
            sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale, **kw)
    if (sinks is None and k_scale is None and q.shape[0] and cpu_native.layer_ops_apply(q, k_cache, v_cache)
            and q.dim() == 3 and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and k_cache.shape[-1] == q.shape[-1] and q.shape[1] % k_cache.shape[2] == 0
            and seq_lens.shape == (q.shape[0],) and block_table.dim() == 2 and block_table.shape[0] == q.shape[0]):
        return cpu_native.decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window)
    if (sinks is None and k_scale is not None and q.shape[0] and q.dim() == 3
            and q.dtype in (torch.float32, torch.bfloat16) and cpu_native.available()
            and k_cache.dtype == v_cache.dtype in (torch.int8, torch.float8_e4m3fn)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and k_cache.shape[-1] == q.shape[-1] and q.shape[1] % k_cache.shape[2] == 0
            and k_scale.shape == v_scale.shape == k_cache.shape[:3]
            and seq_lens.shape == (q.shape[0],) and block_table.dim() == 2 and block_table.shape[0] == q.shape[0]):
        # int8 / fp8 codes read as they are by the native AVX-512 path (None: a shape it does not take)
        out = cpu_native.decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window,
                                          k_scale, v_scale)
        if out is not None:
            return out
    # One query row: ATen's fp32 CPU attention is ~2x faster than its bf16 path at these sizes,
    # and the upcasts are tiny.
    qf = q.float().unsqueeze(2)  # [B, Hq, 1, D]
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            rows.append(qf.new_zeros(qf.shape[1:]).unsqueeze(0))
            continue
        start = max(0, n - sliding_window) if sliding_window is not None else 0
        k, v = _context(k_cache, v_cache, block_table[b], start, n)
        if k_scale is not None:
            # int8 / fp8 codes: dequantize only this sequence's (windowed) context.
            ks, vs = _context(k_scale, v_scale, block_table[b], start, n)
            k, v = k.float() * ks.unsqueeze(-1), v.float() * vs.unsqueeze(-1)
        mask = None
        if sinks is not None:
            k, v, mask = _with_sinks(k.float(), v.float(), None, sinks)
        rows.append(F.scaled_dot_product_attention(qf[b : b + 1], k.float(), v.float(), attn_mask=mask, scale=scale,
                                                   enable_gqa=True))
    out = rows[0] if len(rows) == 1 else torch.cat(rows)
    return out.squeeze(2).to(q.dtype)


def paged_attention_prefill_cpu(q, k_cache, v_cache, *, cu_seqlens_q, seq_lens, block_table, scale,
                                sliding_window=None, softcap=None, max_seqlen_q=None, sinks=None):
    if softcap is not None:
        kw = {} if sinks is None else {"sinks": sinks}
        return implementation("paged_attention_prefill", "reference")(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table,
            scale=scale, sliding_window=sliding_window, softcap=softcap, max_seqlen_q=max_seqlen_q, **kw)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        t0, t1 = cu[b], cu[b + 1]
        qlen = t1 - t0
        if qlen <= 0 or n <= 0:
            continue
        first = n - qlen  # position of the first query token
        start = max(0, first - sliding_window + 1) if sliding_window is not None else 0
        k, v = _context(k_cache, v_cache, block_table[b], start, n)
        qb = q[t0:t1].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if start == 0 and first == 0 and sliding_window is None and sinks is None:
            o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), scale=scale, is_causal=True,
                                               enable_gqa=True)
        else:
            qpos = torch.arange(first, n).view(qlen, 1)
            kpos = torch.arange(start, n).view(1, n - start)
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            if sinks is None:
                o = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
            else:
                k, v, add = _with_sinks(k.float(), v.float(), mask, sinks)
                o = F.scaled_dot_product_attention(qb.float(), k, v, attn_mask=add, scale=scale, enable_gqa=True)
        out[t0:t1] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _on_cpu(cap) -> bool:
    return cap.device_type == "cpu"


register("paged_attention_decode", "cpu", paged_attention_decode_cpu, priority=5, available=_on_cpu)
register("paged_attention_prefill", "cpu", paged_attention_prefill_cpu, priority=5, available=_on_cpu)
