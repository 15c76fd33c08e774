"""Triton kernel of :func:`infercore.ops.moe.routing.moe_route_topk`: softmax and top-k in one launch per step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...devices import register


@triton.jit
def _route_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       RENORM: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(valid, p, -1.0)
    slots = tl.arange(0, K_PAD)  # TOP_K slots used, padded to a power of two (zero weights)
    chosen_w = tl.zeros([K_PAD], dtype=tl.float32)
    chosen_i = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id among equal maxima
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_i = tl.where(slots == j, idx, chosen_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    tl.store(w_ptr + t * TOP_K + slots, chosen_w.to(w_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_i, mask=slots < TOP_K)


def moe_route_topk_triton(router_logits, *, top_k, renormalize, out_dtype=torch.float32):
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((T, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        _route_topk_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                                 K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize,
                                 BLOCK_E=max(triton.next_power_of_2(E), 16))  # fmt: skip
    return weights, ids


register("moe_route_topk", "triton", moe_route_topk_triton, priority=10,
         available=lambda cap: cap.is_cuda and cap.triton)  # fmt: skip
