"""Pure-PyTorch causal attention that also returns per-key attention scores (H2O / SnapKV).

The obviously-correct version: each sequence's full ``[Hq, L, L]`` probability matrix is materialized,
the output is ``P @ V`` and the key scores are column sums of ``P``. It is the specification of the
Triton kernels (``triton_scores.py``), which never build that matrix, and the eager peer of the
benchmark (:func:`dense_attention_with_scores` has no host syncs, so ``torch.compile`` takes it whole).
"""

from __future__ import annotations

import torch


def dense_attention_with_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    score_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q ``[L, Hq, D]``, k/v ``[L, Hk, D]`` (``Hq % Hk == 0``, query head h reads KV head
    ``h // (Hq / Hk)``) -> ``(out [L, Hq, D] in q.dtype, head_scores [L, Hq] fp32)``.

    ``head_scores[j, h] = sum_i p[h, i, j]`` over the queries i >= j (causal) that are among the last
    ``score_window`` positions (all when None). The matmuls run in the inputs' dtype (fp32 accumulation
    by the BLAS; pass fp32 inputs for an fp32 reference), scale / softcap / softmax in fp32.
    """
    L, hq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    qg = q.reshape(L, hk, group, d).permute(1, 2, 0, 3)  # [Hk, G, L, D], heads h = kv_head * G + g
    kh = k.permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, L, D], broadcast over the group
    vh = v.permute(1, 0, 2).unsqueeze(1)
    s = torch.matmul(qg, kh.transpose(-1, -2)).float().mul_(scale)  # [Hk, G, L, L]
    if softcap is not None:
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill_(~causal, float("-inf")), dim=-1)
    out = torch.matmul(p.to(v.dtype), vh)  # [Hk, G, L, D]
    rows = p if score_window is None else p[..., max(L - score_window, 0) :, :]
    scores = rows.sum(dim=-2)  # [Hk, G, L]
    return out.permute(2, 0, 1, 3).reshape(L, hq, d).to(q.dtype), scores.permute(2, 0, 1).reshape(L, hq)


def attention_with_key_scores_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    score_window: int | None = None,
    max_seqlen: int | None = None,
    head_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`~infercore.ops.attention.scores.attention_with_key_scores`: q ``[T, Hq, D]``,
    k/v ``[T, Hk, D]`` ragged by int32 ``cu_seqlens [B+1]``. Returns ``(out [T, Hq, D] in q.dtype,
    key_scores [T, Hk] fp32, head_scores [T, Hq] fp32 or None)``; math in fp32 whatever the inputs."""
    del max_seqlen  # a launch hint for kernels; the reference reads the lengths
    T, hq, d = q.shape
    hk = k.shape[1]
    out = torch.zeros_like(q)
    per_head = torch.zeros(T, hq, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        if s1 == s0:
            continue
        o, sc = dense_attention_with_scores(q[s0:s1].float(), k[s0:s1].float(), v[s0:s1].float(), scale=scale,
                                            softcap=softcap, score_window=score_window)  # fmt: skip
        out[s0:s1] = o.to(q.dtype)
        per_head[s0:s1] = sc
    key_scores = per_head.view(T, hk, hq // hk).sum(-1)
    return out, key_scores, (per_head if head_scores else None)


def select_kv_tokens_ref(key_scores: torch.Tensor, cu_seqlens: torch.Tensor, budget: int, *, window: int,
                         pool_kernel: int = 7) -> torch.Tensor:  # fmt: skip
    """SnapKV selection, vectorized over sequences and heads (see
    :func:`~infercore.ops.attention.scores.select_kv_tokens` for the contract; arguments already checked).

    Each sequence's candidates (its tokens before the last ``window``) are laid out in one padded
    ``[B, Hk, C]`` row per head with -inf past the sequence's own candidates, so the max-pool never
    reads a neighbour sequence (its -inf padding loses every max); the padding is masked again after
    the pool, so top-k never picks it (every sequence has at least ``budget - window`` candidates).
    """
    T, hk = key_scores.shape
    dev = key_scores.device
    B = cu_seqlens.shape[0] - 1
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    n_cand = lens - window  # [B]
    C = int(n_cand.max()) if B else 0
    keep = budget - window
    pos = torch.arange(C, device=dev)
    valid = pos[None, :] < n_cand[:, None]  # [B, C]
    rows = (starts[:, None] + pos[None, :]).clamp(max=max(T - 1, 0))
    cand = key_scores.float()[rows]  # [B, C, Hk]
    cand = cand.masked_fill(~valid[..., None], float("-inf")).permute(0, 2, 1)  # [B, Hk, C]
    if pool_kernel > 1 and C > 0:
        cand = torch.nn.functional.max_pool1d(cand, pool_kernel, stride=1, padding=pool_kernel // 2)
        cand = cand.masked_fill(~valid[:, None, :], float("-inf"))  # the pool spread into the padding too
    top = cand.topk(keep, dim=-1).indices if keep > 0 else cand.new_empty(B, hk, 0, dtype=torch.long)
    last = n_cand[:, None, None] + torch.arange(window, device=dev)  # the observation window, always kept
    picked = torch.cat([top, last.expand(B, hk, window)], dim=-1)
    return picked.sort(dim=-1).values
