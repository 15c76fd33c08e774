"""Pure-PyTorch token sampling.

Randomness is the exponential race ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``, which picks token i
with probability ``p_i`` (it is Gumbel-max in disguise: ``-log E`` is Gumbel). The noise of a row
comes from a generator seeded by that row's ``(seed, offset)`` only, so a request reproduces the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, offset: int) -> int:
    """Mix ``(seed, offset)`` into one 64-bit generator seed (splitmix64 finalizer).

    Consecutive offsets of one seed and equal offsets of nearby seeds land far apart, unlike
    ``seed + offset`` which would make request (s, t+1) replay request (s+1, t).
    """
    x = (seed * 0x9E3779B97F4A7C15 + offset + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_repetition_penalty(
    logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF repetition penalty: for every token id present in the row of ``prev_tokens``, a positive
    logit is divided by the penalty and a negative one multiplied by it.

    Args:
        logits: ``[B, V]`` float (returned as a new tensor of the same dtype).
        prev_tokens: ``[B, L]`` int32/int64 token ids, ``-1`` = padding (ignored); repeats count once.
        penalty: fp32 ``[B]``, 1.0 = off.
    """
    b, v = logits.shape
    # Padding points at an extra column that is dropped, so no masking of the index is needed.
    idx = torch.where(prev_tokens >= 0, prev_tokens.long(), v)
    seen = torch.zeros(b, v + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, idx, True)
    seen = seen[:, :v]
    p = penalty.to(logits.dtype).unsqueeze(1)
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalty(
    logits: torch.Tensor, output_tokens: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI presence / frequency penalties: ``logits - frequency * count - presence * (count > 0)``, where
    ``count`` is how often each id occurs in the row of ``output_tokens``.

    Args:
        logits: ``[B, V]`` float; the result is fp32 (a new tensor).
        output_tokens: ``[B, L]`` int32/int64 generated token ids, ``-1`` = padding (ignored).
        presence, frequency: fp32 ``[B]``, 0.0 = off.
    """
    b, v = logits.shape
    idx = torch.where(output_tokens >= 0, output_tokens.long(), v)
    count = torch.zeros(b, v + 1, dtype=torch.float32, device=logits.device)
    count.scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.float32, device=logits.device))
    count = count[:, :v]
    return logits.float() - frequency.float().unsqueeze(1) * count - presence.float().unsqueeze(1) * (count > 0)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (set to ``-inf``) the tokens removed by top-k, then top-p, then min-p (HF semantics).

    Args:
        logits: ``[B, V]`` float, already divided by the temperature.
        top_k: int32 ``[B]``; keep tokens whose logit is >= the k-th largest (ties at the boundary are
            kept); 0 (or >= V) = off.
        top_p: fp32 ``[B]``; among the survivors of top-k, keep the smallest set of most likely tokens
            whose probability mass reaches ``top_p`` (always at least one); 1 = off.
        min_p: fp32 ``[B]``; drop tokens whose probability is below ``min_p * max_prob``; 0 = off.

    Returns:
        ``[B, V]`` new tensor in ``logits.dtype``.
    """
    b, v = logits.shape
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)

    k = top_k.long()
    k = torch.where((k <= 0) | (k > v), v, k)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = torch.where(sorted_logits < kth, neg_inf, sorted_logits)

    # Top-p on the descending order: a token survives if the mass strictly before it is < top_p,
    # which is HF's "ascending cumsum <= 1 - top_p is removed" read from the other end, and keeps
    # the most likely token unconditionally.
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_p = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    sorted_logits = torch.where(drop_p, neg_inf, sorted_logits)

    # Min-p compares with the most likely token, whose probability ratio to any other survivor is
    # unchanged by the renormalization after top-k/top-p, so the threshold can use these probs.
    probs = sorted_logits.float().softmax(dim=-1)
    drop_min = probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = torch.where(drop_min, neg_inf, sorted_logits)

    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_noise(seeds: list[int], offsets: list[int], vocab: int) -> torch.Tensor:
    """``[B, V]`` fp32 Exp(1) noise on the CPU, row b drawn from a generator seeded by row_seed(b)."""
    out = torch.empty(len(seeds), vocab, dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    for b, (s, o) in enumerate(zip(seeds, offsets)):
        gen.manual_seed(row_seed(s, o))
        out[b].exponential_(generator=gen)
    return out


def sample_ref(logits: torch.Tensor, params, *, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    x = logits.float()
    if prev_tokens is not None:
        x = apply_repetition_penalty(x, prev_tokens, params.repetition_penalty)
    greedy_tokens = x.argmax(dim=-1)
    temp = params.temperature
    greedy = temp == 0
    # One host sync decides which work is needed at all (the all-greedy step skips everything).
    all_greedy, any_filter = torch.stack(
        [greedy.all(), ((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)).any()]
    ).tolist()
    if all_greedy:
        return greedy_tokens
    x = x / torch.where(greedy, 1.0, temp).unsqueeze(1)
    if any_filter:
        x = apply_top_k_top_p_min_p(x, params.top_k, params.top_p, params.min_p)
    probs = x.softmax(dim=-1)
    noise = exponential_noise(params.seeds.tolist(), params.offsets.tolist(), x.shape[1]).to(x.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)
