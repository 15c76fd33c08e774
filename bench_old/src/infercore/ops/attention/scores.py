"""Causal attention that also returns per-key attention scores, and SnapKV token selection.

KV-cache compression keeps the keys that attention used most: H2O sums each key's softmax probability
over all the queries that see it, SnapKV over an observation window of the prompt's last queries and
then keeps the top keys (max-pooled over neighbours) plus the window itself. Stock FlashAttention never
exposes the probabilities, and computing them naively materializes an ``[L, L]`` matrix per head.
:func:`attention_with_key_scores` returns both the attention output and the per-key sums; its Triton
implementation (``triton_scores.py``, FlashTensor's split) writes the row log-sum-exp in a flash
forward and recomputes the score tiles per key tile in a second kernel, with no ``[T, T]`` tensor.
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .scores_naive import attention_with_key_scores_ref, select_kv_tokens_ref

__all__ = ["attention_with_key_scores", "select_kv_tokens"]

_OP = "attention_with_key_scores"


def _positive_int(op: str, name: str, x: object, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{op}: {name} must be an int{' or None' if allow_none else ''}, got {type(x).__name__}")
    if x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{op}: {name} must be {'>= 0' if allow_zero else '> 0'}, got {x}")


def _check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, total: int) -> int:
    """Values of int32 ``cu_seqlens [B+1]``: starts at 0, non-decreasing, ends at ``total``. Returns the
    longest sequence's length (one host sync)."""
    if cu_seqlens.shape[0] == 1:
        if int(cu_seqlens[0]) != 0 or total != 0:
            raise ValueError(f"{op}: cu_seqlens must start at 0 and end at T = {total}")
        return 0
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    first, last, shortest, longest = torch.stack([cu_seqlens[0], cu_seqlens[-1], lens.min(), lens.max()]).tolist()
    if first != 0 or last != total:
        raise ValueError(f"{op}: cu_seqlens must start at 0 and end at T = {total}, got {first} ... {last}")
    if shortest < 0:
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing")
    return longest


def attention_with_key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    score_window: int | None = None,
    max_seqlen: int | None = None,
    return_head_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal self-attention over a ragged batch of whole sequences, plus each key's accumulated attention.

    Args:
        q: ``[T, Hq, D]`` fp32/fp16/bf16, the sequences concatenated (tokens first).
        k, v: ``[T, Hk, D]`` in q's dtype, ragged like q; ``Hq % Hk == 0`` (GQA: query head h reads KV
            head ``h // (Hq / Hk)``).
        cu_seqlens: int32 ``[B+1]``; sequence b owns rows ``cu_seqlens[b]:cu_seqlens[b+1]`` and its
            token i attends to its tokens ``0..i`` (no cached prefix).
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled scores before the softmax; None = off.
        score_window: only the last ``score_window`` queries of each sequence count towards the scores
            (SnapKV's observation window); None = every query (H2O's accumulated attention).
        max_seqlen: optional host-side length of the longest sequence (a launch hint for kernels; it must
            not be smaller than the real one). When None it is read from ``cu_seqlens`` (one device sync),
            which also checks ``cu_seqlens``' values (0 first, T last, non-decreasing); when given, they
            are trusted.
        return_head_scores: also return the per-query-head scores (the kernels have them anyway).

    Returns:
        ``(out, key_scores)`` or, with ``return_head_scores``, ``(out, key_scores, head_scores)``:
        ``out [T, Hq, D]`` in q's dtype; ``key_scores [T, Hk]`` fp32 with ``key_scores[j, kvh] = sum over
        the query heads h of group kvh and the counted queries i >= j of j's sequence of p[i, h, j]``,
        p the softmax probability; ``head_scores [T, Hq]`` fp32, the same sums per query head (summing
        them over each group gives ``key_scores``). Softmax in fp32.
    """
    op = _OP
    V.floating(op, "q", q)
    V.ndim(op, "q", q, 3, "[tokens, q_heads, head_dim]")
    V.dim_at_least_one(op, "q", q, 1, "q_heads")
    V.dim_at_least_one(op, "q", q, 2, "head_dim")
    for name, t in (("k", k), ("v", v)):
        V.floating(op, name, t)
        V.ndim(op, name, t, 3, "[tokens, kv_heads, head_dim]")
        V.same_dtype(op, name, t, "q", q)
    T, hq, d = q.shape
    if k.shape[0] != T or k.shape[2] != d:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)}, expected [T, Hk, D] with T = {T}, D = {d}")
    if v.shape != k.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    hk = k.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k's kv heads ({hk})")
    V.integer(op, "cu_seqlens", cu_seqlens, (torch.int32,))
    V.ndim(op, "cu_seqlens", cu_seqlens, 1, "[batch + 1]")
    V.dim_at_least_one(op, "cu_seqlens", cu_seqlens, 0, "batch + 1 entries")
    V.number(op, "scale", scale, positive=True)
    if softcap is not None:
        V.number(op, "softcap", softcap, positive=True)
    _positive_int(op, "score_window", score_window, allow_none=True)
    _positive_int(op, "max_seqlen", max_seqlen, allow_none=True, allow_zero=True)
    V.flag(op, "return_head_scores", return_head_scores)
    V.same_device(op, "q", q, k=k, v=v, cu_seqlens=cu_seqlens)
    if max_seqlen is None:
        max_seqlen = _check_cu_seqlens(op, cu_seqlens, T)
    out, key_scores, head_scores = dispatch(op, q.device)(
        q, k, v, cu_seqlens=cu_seqlens, scale=float(scale), softcap=None if softcap is None else float(softcap),
        score_window=score_window, max_seqlen=max_seqlen, head_scores=return_head_scores,
    )  # fmt: skip
    return (out, key_scores, head_scores) if return_head_scores else (out, key_scores)


def select_kv_tokens(
    key_scores: torch.Tensor,
    cu_seqlens: torch.Tensor,
    budget: int,
    *,
    window: int,
    pool_kernel: int = 7,
) -> torch.Tensor:
    """SnapKV's choice of the tokens to keep in a compressed KV cache, per sequence and KV head.

    Each sequence's last ``window`` tokens (the observation window) are always kept. Its other tokens
    (the candidates) are ranked by their score max-pooled over the ``pool_kernel`` neighbouring
    candidates (odd; 1 = no pooling; the pool never reaches into the window or another sequence), and
    the top ``budget - window`` are kept. Ties rank in an unspecified order.

    Args:
        key_scores: ``[T, Hk]`` float (e.g. from :func:`attention_with_key_scores` with
            ``score_window=window``), rows ragged by ``cu_seqlens``.
        cu_seqlens: int32 ``[B+1]`` as in :func:`attention_with_key_scores`, on key_scores' device.
        budget: tokens kept per sequence and head, ``window <= budget <= every sequence's length``
            (ValueError otherwise: a sequence no longer than the budget needs no selection, so callers
            leave such sequences out).
        window: observation window, ``0 <= window``.
        pool_kernel: odd positive max-pool width.

    Returns:
        int64 ``[B, Hk, budget]``: positions within each sequence (add ``cu_seqlens[b]`` for rows of the
        ragged batch), sorted ascending per head. One host sync (the lengths).
    """
    op = "select_kv_tokens"
    V.floating(op, "key_scores", key_scores)
    V.ndim(op, "key_scores", key_scores, 2, "[tokens, kv_heads]")
    V.integer(op, "cu_seqlens", cu_seqlens, (torch.int32,))
    V.ndim(op, "cu_seqlens", cu_seqlens, 1, "[batch + 1]")
    V.dim_at_least_one(op, "cu_seqlens", cu_seqlens, 0, "batch + 1 entries")
    V.same_device(op, "key_scores", key_scores, cu_seqlens=cu_seqlens)
    _positive_int(op, "budget", budget)
    _positive_int(op, "window", window, allow_zero=True)
    _positive_int(op, "pool_kernel", pool_kernel)
    if pool_kernel % 2 == 0:
        raise ValueError(f"{op}: pool_kernel must be odd, got {pool_kernel}")
    if window > budget:
        raise ValueError(f"{op}: window ({window}) must not exceed budget ({budget})")
    _check_cu_seqlens(op, cu_seqlens, key_scores.shape[0])
    if cu_seqlens.shape[0] > 1:
        shortest = int((cu_seqlens[1:] - cu_seqlens[:-1]).min())
        if budget > shortest:
            raise ValueError(f"{op}: budget ({budget}) exceeds the shortest sequence ({shortest} tokens); "
                             "leave sequences no longer than the budget out of the selection")  # fmt: skip
    return select_kv_tokens_ref(key_scores, cu_seqlens, budget, window=window, pool_kernel=pool_kernel)


register(_OP, "reference", attention_with_key_scores_ref)
