"""Top-k routing of a sparse MoE layer: softmax over the router logits, the k largest, optionally renormalized.

The reference is the torch sequence HF runs (softmax in fp32, ``torch.topk``, divide by the sum): five launches
per layer at decode. The Triton kernel (``routing_triton.py``) does it in one: a program per token loads the
logits row, takes the softmax in fp32 and picks the k largest one at a time (an argmax, then that expert masked
out; equal probabilities go to the lower id first), writing the weights in the activations' dtype and the ids as
int32 (what the routed expert op reads).
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register


def _check(op: str, router_logits, top_k, renormalize, out_dtype) -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"{op}: router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.ndim != 2:
        raise ValueError(f"{op}: router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise TypeError(f"{op}: router_logits must be a floating tensor, got {router_logits.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"{op}: top_k must be an int in [1, {router_logits.shape[1]}], got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"{op}: renormalize must be a bool, got {type(renormalize).__name__}")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"{op}: out_dtype must be a floating torch.dtype, got {out_dtype!r}")


def moe_route_topk(
    router_logits: torch.Tensor, *, top_k: int, renormalize: bool, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing (Qwen / Mixtral style).

    Args:
        router_logits: ``[T, E]`` any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: rescale the chosen probabilities to sum to 1 (HF ``norm_topk_prob``).
        out_dtype: dtype of the returned weights (computed in fp32, then cast, as HF casts them to the
            activations' dtype before the experts scale by them).

    Returns:
        ``(weights [T, top_k] out_dtype, ids [T, top_k])``, largest first; ids int64 from the reference, int32 from
        the Triton kernel (the routed expert op takes either).
    """
    _check("moe_route_topk", router_logits, top_k, renormalize, out_dtype)
    return dispatch("moe_route_topk", router_logits.device)(router_logits, top_k=top_k, renormalize=renormalize,
                                                             out_dtype=out_dtype)  # fmt: skip


def moe_route_topk_ref(router_logits, *, top_k, renormalize, out_dtype=torch.float32):
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


register("moe_route_topk", "reference", moe_route_topk_ref)
