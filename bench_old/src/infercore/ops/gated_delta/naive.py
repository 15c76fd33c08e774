"""Pure-PyTorch gated delta rule: the token recurrence (the specification) and the chunked form.

Gated DeltaNet (Yang et al., 2024; Qwen3-Next's linear attention). Per value head, with state
``S`` of shape ``[K, V]``, for each token ``t`` of a sequence::

    S = exp(g_t) * S                                # gated decay (g_t <= 0, log space)
    S = S + k_t (beta_t * (v_t - k_t^T S))^T        # delta rule: correct what S predicts for k_t
    o_t = (scale * q_t)^T S

Layouts (tokens first, ragged): ``q, k [T, Hk, K]``, ``v [T, Hv, V]``, ``g, beta [T, Hv]``,
``cu_seqlens`` int32 ``[B + 1]``; states live in a pool ``[num_slots, Hv, K, V]`` (fp32) indexed
by int32 ``state_slots [B]``. ``Hv`` is a multiple of ``Hk``: value head ``h`` reads key head
``h // (Hv // Hk)`` (grouped value attention, HF ``repeat_interleave``). Math is in fp32; the
output has ``v``'s dtype.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / HF convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    hv, hk = v.shape[1], k.shape[1]
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    return q * scale, k, v.float(), g.float(), beta.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token (the spec). q,k ``[L, Hk, K]``, v ``[L, Hv, V]``, g/beta
    ``[L, Hv]``, state ``[Hv, K, V]`` or None (zeros). Returns ``(o [L, Hv, V] fp32, state fp32)``."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    L, H, K = q.shape
    S = torch.zeros(H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    if initial_state is not None:
        S = initial_state.float().clone()
    out = torch.empty(L, H, v.shape[-1], dtype=torch.float32, device=q.device)
    for t in range(L):
        S = S * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], S)
        delta = (v[t] - pred) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks of ``chunk_size`` (the WY / UT-transform form): inside a chunk the
    delta-rule updates are batched into triangular solves and matmuls; chunks are scanned in order.
    Same arguments and results as :func:`recurrent_gated_delta_rule`; ``chunk_size >= 1``."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_gated_delta_rule: chunk_size must be a positive int, got {chunk_size!r}")
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    L, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-L) % C
    # [H, N, C, ...]: heads first so each chunk is a batch of small matmuls.
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))
    n = (L + pad) // C
    q, k, v = (x.reshape(H, n, C, x.shape[-1]) for x in (q, k, v))  # explicit: n may be 0
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C)
    gc = g.cumsum(-1)  # log decay from the chunk start through position i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = prod of gates over (j, i] for j <= i
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + A) u = beta v, A strictly lower: A[i, j] = beta_i k_i.k_j decay[i, j]
    # (solve_triangular with unitriangular=True reads only the strictly lower part of A)
    A = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(A, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        S = initial_state.float().clone()
    out = torch.empty(H, n, C, V, dtype=torch.float32, device=q.device)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S  # the part of each value the old state does not predict
        out[:, c] = (q[:, c] * gc[:, c, :, None].exp()) @ S + attn[:, c] @ v_new
        last = gc[:, c, -1]
        k_tail = k[:, c] * (last[:, None] - gc[:, c]).exp()[..., None]
        S = S * last.exp()[:, None, None] + k_tail.transpose(-1, -2) @ v_new
    return out.reshape(H, n * C, V)[:, :L].transpose(0, 1), S


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, *, cu_seqlens: torch.Tensor, state_slots: torch.Tensor,
    has_initial_state: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:  # fmt: skip
    """Ragged batch (layouts of the module docstring; arguments validated by the public wrapper):
    each sequence runs :func:`chunk_gated_delta_rule` from its slot's state (or zeros) and writes
    its final state back into the slot. A negative slot is a padding sequence (as in decode): zero
    initial state, no state write. Returns ``[T, Hv, V]`` in ``v.dtype``."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    slots = state_slots.tolist()
    init = has_initial_state.tolist()
    for b, slot in enumerate(slots):
        s, e = bounds[b], bounds[b + 1]
        # Tested before indexing: Python's negative indexing would use the pool's last slot.
        state = state_pool[slot] if init[b] and slot >= 0 else None
        o, final = chunk_gated_delta_rule(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
        out[s:e] = o.to(v.dtype)
        if slot >= 0:
            state_pool[slot] = final.to(state_pool.dtype)
    return out


def fused_recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, *, state_slots: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:  # fmt: skip
    """Decode: one token per sequence (``q, k [B, Hk, K]``, ``v [B, Hv, V]``, ``g, beta [B, Hv]``),
    state updated in its slot. A negative slot is a padding row: it starts from a zero state and
    writes none. Returns ``[B, Hv, V]`` in ``v.dtype``."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for b, slot in enumerate(state_slots.tolist()):
        init = state_pool[slot] if slot >= 0 else torch.zeros_like(state_pool[0])
        o, final = recurrent_gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], init,
            scale=scale, use_qk_l2norm=use_qk_l2norm,
        )  # fmt: skip
        out[b] = o[0].to(v.dtype)
        if slot >= 0:
            state_pool[slot] = final.to(state_pool.dtype)
    return out
