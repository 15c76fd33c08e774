"""Pure-PyTorch causal depthwise conv1d with a per-request state pool (Mamba2 / Gated DeltaNet).

Layouts: ``x [T, C]`` tokens first (ragged, ``cu_seqlens`` int32 ``[B + 1]``); ``weight [C, W]``;
``bias [C]`` or None; ``conv_state [num_slots, C, W - 1]`` holding each request's last ``W - 1``
inputs, oldest first, indexed by int32 ``state_slots [B]``. Output ``y[t, c] = act(bias[c] +
sum_j weight[c, j] * xx[t + j, c])`` where ``xx`` is the state followed by the sequence's inputs.
Math in fp32; outputs in ``x.dtype``.
"""

from __future__ import annotations

import torch


def _conv(xx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    # xx [W - 1 + L, C] fp32 -> [L, C]
    W = weight.shape[1]
    L = xx.shape[0] - (W - 1)
    w = weight.float()
    y = sum(xx[j : j + L] * w[:, j] for j in range(W))
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    return y


def causal_conv1d_prefill_ref(
    x, weight, conv_state, *, cu_seqlens, state_slots, has_initial_state, bias, activation
):
    W = weight.shape[1]
    out = torch.empty_like(x)
    bounds, slots, init = cu_seqlens.tolist(), state_slots.tolist(), has_initial_state.tolist()
    for b, slot in enumerate(slots):
        s, e = bounds[b], bounds[b + 1]
        # A negative slot is a padding sequence (as in decode): zero history, no state write. Python's
        # negative indexing would otherwise read and overwrite the pool's last slot.
        if init[b] and slot >= 0:
            prev = conv_state[slot].float().t()
        else:
            prev = x.new_zeros(W - 1, x.shape[1], dtype=torch.float32)
        xx = torch.cat([prev, x[s:e].float()])
        out[s:e] = _conv(xx, weight, bias, activation).to(x.dtype)
        if slot >= 0:
            conv_state[slot] = xx[xx.shape[0] - (W - 1) :].t().to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(x, weight, conv_state, *, state_slots, bias, activation):
    slots = state_slots.long()
    valid = slots >= 0  # a negative slot is a padding row: zero history, no state write
    prev = conv_state[slots.clamp(min=0)].float() * valid[:, None, None]
    xx = torch.cat([prev.transpose(1, 2), x.float()[:, None, :]], dim=1)  # [B, W, C]
    w = weight.float().t()  # [W, C]
    y = (xx * w).sum(1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    conv_state[slots[valid]] = xx[valid, 1:].transpose(1, 2).to(conv_state.dtype)
    return y.to(x.dtype)
