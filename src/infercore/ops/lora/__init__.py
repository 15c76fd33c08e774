"""Multi-LoRA batched operators (Punica's BGMV shrink / expand): every token applies its own adapter.

A LoRA layer adds ``B @ (A @ x)`` (scaling folded into ``B``) to a base linear's output. With many
adapters resident in ``S`` slots, each token ``t`` of a batch names its slot in ``indices[t]``
(``-1``: no adapter) and the update runs in two steps:

* :func:`lora_shrink` ``s[t] = a[indices[t]] @ x[t]`` -> fp32 ``[T, n_slices * r]`` (the low-rank
  activations of every slice of a merged projection, stacked);
* :func:`lora_expand_` ``y[t, n] += s[t, j*r : (j+1)*r] . b[indices[t], n, :]`` in place, where
  ``j`` is the slice that owns output column ``n`` (``slice_bounds``).

Layouts (row-major, one slot per leading index so an adapter is loaded by writing into a slot):

* ``a`` ``[S, n_slices * r, K]``: the A matrices of a merged projection's slices stacked on dim 1
  (qkv: ``[A_q; A_k; A_v]``);
* ``b`` ``[S, N, r]``: the B matrices stacked along the output columns (qkv: ``[B_q; B_k; B_v]``,
  which is ``N = q_size + 2 * kv_size``), each ``[N_j, r]``;
* ``slice_bounds``: the output column where each slice after the first starts (qkv:
  ``(q_size, q_size + kv_size)``; gate_up: ``(intermediate,)``; a plain linear: ``()``).

Slot indices are read on the device and never range-checked there (a check would synchronize and
break CUDA-graph capture): an index ``>= S`` is undefined behaviour in the Triton kernels (the
reference raises). Any negative index means "no adapter", as ``-1``.
"""

from __future__ import annotations

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import lora_expand_ref, lora_shrink_ref

__all__ = ["MAX_SLICES", "lora_expand_", "lora_shrink"]

# Slices of one merged projection (qkv has 3, gate_up 2); the Triton expand takes the bounds as scalars.
MAX_SLICES = 4


def _check_indices(op: str, indices: object, T: int) -> torch.Tensor:
    V.integer(op, "indices", indices)
    if indices.shape != (T,):
        raise ValueError(f"{op}: indices must be 1-D [{T}] (one slot per token), got shape {tuple(indices.shape)}")
    return indices


def _check_order(op: str, order: object, indices: torch.Tensor) -> None:
    if order is None:
        return
    V.integer(op, "order", order)
    if order.shape != indices.shape:
        raise ValueError(f"{op}: order must be 1-D [{indices.shape[0]}] (the tokens in slot order), got shape "
                         f"{tuple(order.shape)}")  # fmt: skip
    V.same_device(op, "indices", indices, order=order)


def _check_shrink(x: object, a: object, indices: object) -> None:
    op = "lora_shrink"
    V.floating(op, "x", x)
    V.ndim(op, "x", x, 2, "[T, K]")
    if x.stride(-1) != 1:
        raise ValueError(f"{op}: x must be contiguous in its last dimension, got strides {x.stride()}")
    V.floating(op, "a", a)
    V.ndim(op, "a", a, 3, "[S, n_slices * r, K]")
    V.same_dtype(op, "a", a, "x", x)
    V.dim_at_least_one(op, "a", a, 0, "S (slots)")
    V.dim_at_least_one(op, "a", a, 1, "rows (n_slices * r)")
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: a [S, R, K] must have K = x.shape[1] = {x.shape[1]}, got shape {tuple(a.shape)}")
    _check_indices(op, indices, x.shape[0])
    V.same_device(op, "x", x, a=a, indices=indices)


def _check_bounds(op: str, slice_bounds: object, N: int) -> tuple[int, ...]:
    if not isinstance(slice_bounds, (tuple, list)):
        raise TypeError(f"{op}: slice_bounds must be a tuple of ints, got {type(slice_bounds).__name__}")
    bounds = tuple(slice_bounds)
    for v in bounds:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{op}: slice_bounds must hold ints, got {v!r} in {bounds}")
    if len(bounds) + 1 > MAX_SLICES:
        raise ValueError(f"{op}: slice_bounds allows at most {MAX_SLICES} slices ({MAX_SLICES - 1} bounds), "
                         f"got {len(bounds)} bounds")  # fmt: skip
    prev = 0
    for v in bounds:
        if not prev < v < N:
            raise ValueError(f"{op}: slice_bounds must be strictly increasing, each in (0, N={N}), got {bounds}")
        prev = v
    return bounds


def _check_expand(y: object, s: object, b: object, indices: object, slice_bounds: object) -> tuple[int, ...]:
    op = "lora_expand_"
    V.floating(op, "y", y)
    V.ndim(op, "y", y, 2, "[T, N]")
    if y.stride(-1) != 1:
        raise ValueError(f"{op}: y must be contiguous in its last dimension, got strides {y.stride()}")
    V.floating(op, "s", s, (torch.float32,))
    V.ndim(op, "s", s, 2, "[T, n_slices * r]")
    V.floating(op, "b", b)
    V.ndim(op, "b", b, 3, "[S, N, r]")
    V.dim_at_least_one(op, "b", b, 0, "S (slots)")
    V.dim_at_least_one(op, "b", b, 2, "r (rank)")
    T, N = y.shape
    if b.shape[1] != N:
        raise ValueError(f"{op}: b [S, N, r] must have N = y.shape[1] = {N}, got shape {tuple(b.shape)}")
    bounds = _check_bounds(op, slice_bounds, N)
    width = (len(bounds) + 1) * b.shape[2]
    if s.shape != (T, width):
        raise ValueError(f"{op}: s must be [T, n_slices * r] = [{T}, {len(bounds) + 1} * {b.shape[2]}], "
                         f"got shape {tuple(s.shape)}")  # fmt: skip
    _check_indices(op, indices, T)
    V.same_device(op, "y", y, s=s, b=b, indices=indices)
    return bounds


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor, *,
                order: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token LoRA A: ``out[t] = a[indices[t]] @ x[t]``, accumulated in fp32.

    Args:
        x: ``[T, K]`` fp32/fp16/bf16, last dimension contiguous (rows may be strided).
        a: ``[S, R, K]`` in ``x.dtype``: ``S`` adapter slots, ``R = n_slices * r`` (every slice's A stacked).
        indices: ``[T]`` int32/int64 on x's device, the slot of each token in ``[-1, S)``; ``-1`` (any
            negative) = no adapter, whose output row is 0. Not range-checked on the device.
        order: optional ``[T]`` int tensor, a permutation of the tokens, best sorted by slot
            (``torch.argsort(indices, stable=True)``; not checked on the device: any permutation gives the same
            result, sorting only makes the kernels faster). The grouped Triton kernels (``ops.lora.triton``,
            ``grouped=True`` or from its ``GROUPED_MIN_TOKENS`` tokens, 32 by default) take tiles of tokens in this
            order, each adapter's weights read once per tile, and sort themselves when it is not given; a caller
            running many projections over one step's slots passes it once for all. The reference ignores it.

    Returns:
        ``[T, R]`` fp32.
    """
    _check_shrink(x, a, indices)
    _check_order("lora_shrink", order, indices)
    if order is None:
        return dispatch("lora_shrink", x.device)(x, a, indices)
    return dispatch("lora_shrink", x.device)(x, a, indices, order=order)


def lora_expand_(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    *,
    slice_bounds: tuple[int, ...] = (),
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token LoRA B, added in place: ``y[t, n] += sum_k s[t, j*r + k] * b[indices[t], n, k]``.

    ``j`` = the number of ``slice_bounds`` ``<= n`` (the slice owning column ``n``). Math in fp32, one
    rounding to ``y.dtype``; rows whose index is negative are left untouched.

    Args:
        y: ``[T, N]`` fp32/fp16/bf16 (the base projection's output), last dimension contiguous; updated.
        s: ``[T, n_slices * r]`` fp32, the :func:`lora_shrink` output.
        b: ``[S, N, r]`` fp32/fp16/bf16 (usually ``y.dtype``), every slice's B stacked along ``N``.
        indices: ``[T]`` int32/int64, as in :func:`lora_shrink`.
        slice_bounds: strictly increasing output columns in ``(0, N)`` where slices 1, 2, ... start;
            ``n_slices = len(slice_bounds) + 1 <= MAX_SLICES``.
        order: optional, as in :func:`lora_shrink`.

    Returns:
        ``y``.
    """
    bounds = _check_expand(y, s, b, indices, slice_bounds)
    _check_order("lora_expand_", order, indices)
    if order is None:
        return dispatch("lora_expand_", y.device)(y, s, b, indices, slice_bounds=bounds)
    return dispatch("lora_expand_", y.device)(y, s, b, indices, slice_bounds=bounds, order=order)


register("lora_shrink", "reference", lora_shrink_ref)
register("lora_expand_", "reference", lora_expand_ref)
