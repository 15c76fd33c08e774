"""Triton causal depthwise conv1d against a state pool.

Prefill: one program per (sequence, channel block, token block) computes ``W`` shifted
multiply-adds from global memory (inputs before the sequence come from the slot's state); a second
launch then writes each slot's new state, so no program reads a state another one is overwriting.
Decode: one program per (sequence, channel block) reads the state, emits one output and shifts the
state in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import register


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, cu_ptr, slot_ptr, init_ptr, C,
    s_slot, s_c, s_w,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    cb = tl.program_id(1)
    tb = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - start
    if tb * BLOCK_T >= L:
        return
    slot = tl.load(slot_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b) != 0
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < L
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        pos = t - (W - 1) + j  # input position relative to the sequence start
        wj = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
        in_seq = (pos >= 0) & tmask
        xv = tl.load(x_ptr + (start + pos)[:, None].to(tl.int64) * C + c[None, :],
                     mask=in_seq[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        # A negative slot is a padding sequence: zero history, its state is not read.
        in_state = (pos < 0) & tmask & (pos * 0 + slot >= 0)
        sidx = tl.where(pos < 0, pos + (W - 1), 0)
        sv = tl.load(state_ptr + slot * s_slot + c[None, :] * s_c + sidx[:, None] * s_w,
                     mask=in_state[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        sv = tl.where(init, sv, 0.0)
        acc += (xv + sv) * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + (start + t)[:, None].to(tl.int64) * C + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, C, s_slot, s_c, s_w,
    W: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:  # a padding sequence writes no state
        return
    init = tl.load(init_ptr + b) != 0
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    base = state_ptr + slot * s_slot + c * s_c
    # New entry j is input position L - (W - 1) + j; entries taken from the old state sit at
    # higher indices (j + L), so ascending order never reads an entry already overwritten.
    for j in tl.static_range(W - 1):
        pos = L - (W - 1) + j
        if pos >= 0:
            v = tl.load(x_ptr + (start + pos).to(tl.int64) * C + c, mask=cmask, other=0.0)
            v = v.to(state_ptr.dtype.element_ty)
        else:
            v = tl.load(base + (pos + W - 1) * s_w, mask=cmask, other=0.0)
            v = tl.where(init, v, 0.0).to(state_ptr.dtype.element_ty)
        tl.store(base + j * s_w, v, mask=cmask)


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, slot_ptr, C, s_slot, s_c, s_w,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    smask = cmask & (c * 0 + slot >= 0)  # a negative slot is a padding row: no state read or write
    base = state_ptr + slot * s_slot + c * s_c
    x = tl.load(x_ptr + b * C + c, mask=cmask, other=0.0)
    acc = tl.load(w_ptr + c * W + (W - 1), mask=cmask, other=0.0).to(tl.float32) * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(base + j * s_w, mask=smask, other=0.0)
        acc += tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32) * s.to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * s_w, s, mask=smask)
    tl.store(base + (W - 2) * s_w, x.to(state_ptr.dtype.element_ty), mask=smask)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * C + c, acc.to(y_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d_prefill_(
    x, weight, conv_state, *, cu_seqlens, state_slots, has_initial_state, bias, activation
):
    """See :func:`infercore.ops.conv1d.causal_conv1d_prefill_`."""
    T, C = x.shape
    W = weight.shape[1]
    B = state_slots.shape[0]
    x = x.contiguous()
    y = torch.empty_like(x)
    if B == 0 or T == 0:
        return y
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    BLOCK_C, BLOCK_T = min(128, triton.next_power_of_2(C)), 16
    w = weight.contiguous()
    init = has_initial_state.to(torch.int8)
    grid = (B, triton.cdiv(C, BLOCK_C), triton.cdiv(max(max_len, 1), BLOCK_T))
    strides = conv_state.stride()
    _conv_prefill_kernel[grid](
        x, w, bias if bias is not None else w, conv_state, y, cu_seqlens, state_slots, init, C, *strides,
        W=W, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_C=BLOCK_C, BLOCK_T=BLOCK_T,
    )  # fmt: skip
    _conv_state_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, conv_state, cu_seqlens, state_slots, init, C, *strides, W=W, BLOCK_C=BLOCK_C
    )
    return y


def causal_conv1d_update_(x, weight, conv_state, *, state_slots, bias, activation):
    """See :func:`infercore.ops.conv1d.causal_conv1d_update_`."""
    B, C = x.shape
    W = weight.shape[1]
    x = x.contiguous()
    y = torch.empty_like(x)
    if B == 0:
        return y
    BLOCK_C = min(256, triton.next_power_of_2(C))
    w = weight.contiguous()
    _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, w, bias if bias is not None else w, conv_state, y, state_slots, C, *conv_state.stride(),
        W=W, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return y


_available = lambda cap: cap.is_cuda and cap.triton
register("causal_conv1d_prefill_", "triton", causal_conv1d_prefill_, priority=10, available=_available)
register("causal_conv1d_update_", "triton", causal_conv1d_update_, priority=10, available=_available)
