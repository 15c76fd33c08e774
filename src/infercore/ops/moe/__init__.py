"""Routed experts of a sparse MoE layer: ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``.

The Triton implementation (``triton.py``) sorts the (token, expert) pairs by expert on the device and
runs one program per (expert, output tile) over only that expert's tokens, so it reads each
routed expert's weights once, computes only the routed products and never syncs with the host
(CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...devices import dispatch, register
from .. import _validate as V
from .naive import check_expert_scales, check_moe_args, dequantize_experts, moe_experts_lora_ref, moe_experts_ref

__all__ = ["MoELoRA", "dequantize_experts", "moe_experts_routed"]


@dataclass(frozen=True)
class MoELoRA:
    """Multi-LoRA operands of the routed experts: ``S`` adapter slots of ``E`` experts each, row ``s * E + e`` =
    slot ``s``'s adapter of expert ``e`` (the layouts of ``ops.lora_shrink`` / ``ops.lora_expand_``, the scaling
    folded into ``B``; zeros where an adapter does not target an expert).

    - ``a_gate_up`` ``[S * E, 2 r, H]``: the gate's A (rows ``[0, r)``) and the up projection's (``[r, 2r)``);
    - ``b_gate_up`` ``[S * E, 2 I, r]``: the gate's B (rows ``[0, I)``), the up projection's (``[I, 2I)``);
    - ``a_down`` ``[S * E, r, I]``, ``b_down`` ``[S * E, H, r]``;
    - ``slots`` ``[T]`` int32/int64: each token's slot, negative = none (read on the device, not range-checked);
    - ``live`` (optional) ``[S]`` int32: 0 where a slot's rows are all zero (an adapter without experts), so that
      the GPU kernels skip its pairs' loads; it changes no result.
    """

    a_gate_up: torch.Tensor
    b_gate_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    slots: torch.Tensor
    live: torch.Tensor | None = None


def _check_lora(op: str, lora: object, x: torch.Tensor, gate_up: torch.Tensor) -> None:
    if not isinstance(lora, MoELoRA):
        raise TypeError(f"{op}: lora must be an ops.moe.MoELoRA or None, got {type(lora).__name__}")
    E, two_i, H = gate_up.shape
    a1, b1, a2, b2 = lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down
    for name, t in (("a_gate_up", a1), ("b_gate_up", b1), ("a_down", a2), ("b_down", b2)):
        V.floating(op, f"lora.{name}", t)
        V.ndim(op, f"lora.{name}", t, 3, "[S * E, *, *]")
        V.same_device(op, "x", x, **{f"lora.{name}": t})
    V.integer(op, "lora.slots", lora.slots)
    V.same_device(op, "x", x, **{"lora.slots": lora.slots})
    rows, r = a1.shape[0], a2.shape[1]
    if rows % E or rows == 0:
        raise ValueError(f"{op}: lora.a_gate_up must have S * E rows (E = {E}), got {rows}")
    want = {"a_gate_up": (rows, 2 * r, H), "b_gate_up": (rows, two_i, r), "a_down": (rows, r, two_i // 2),
            "b_down": (rows, H, r)}
    for name, t in (("a_gate_up", a1), ("b_gate_up", b1), ("a_down", a2), ("b_down", b2)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{op}: lora.{name} must be {list(want[name])}, got {list(t.shape)}")
    if lora.slots.shape != (x.shape[0],):
        raise ValueError(f"{op}: lora.slots must be [{x.shape[0]}] (one slot per token), got "
                         f"{list(lora.slots.shape)}")
    if lora.live is not None:
        if lora.live.dtype != torch.int32 or lora.live.shape != (rows // E,):
            raise ValueError(f"{op}: lora.live must be int32 [{rows // E}] (one flag per slot), got "
                             f"{lora.live.dtype} {list(lora.live.shape)}")
        V.same_device(op, "x", x, **{"lora.live": lora.live})


def moe_experts_routed(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, expert_offset: int | None = None, lora: MoELoRA | None = None, activation: str = "silu",
    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k routed experts, SiLU-gated (or ungated squared-ReLU ones, ``activation="relu2"``).

    Args:
        x: ``[T, H]`` fp32/fp16/bf16. gate_up: ``[E, 2I, H]`` (gate rows, then up rows); down:
            ``[E, H, I]``; both in ``x.dtype`` (HF transformers 5 layout).
        weights: ``[T, k]`` routing weights (any float dtype); ids: ``[T, k]`` int32/int64 expert ids
            in ``[0, E)``. All on one device. The id values are not checked (that would read them
            on the host, a sync a CUDA graph cannot hold); an id outside ``[0, E)`` is undefined.
        expert_offset: expert parallelism: ``gate_up`` / ``down`` hold the experts
            ``[expert_offset, expert_offset + E)`` of a larger set, ``ids`` are global, and pairs routed to an
            expert outside that range are skipped (the result is this holder's share of the sum).
        lora: multi-LoRA on the experts (:class:`MoELoRA`): each token adds its slot's adapter of each of its
            experts to the gate / up projections (before the activation) and to the down projection (before the
            routing weight). CUDA-graph safe on CUDA; the reference syncs. SiLU-gated experts only.
        activation: ``"silu"`` (``silu(gate) * up``, ``gate_up [E, 2I, H]``) or ``"relu2"`` (Nemotron-H's ungated
            ``relu(up) ** 2``: ``gate_up`` is then the up projection alone, ``[E, I, H]``).
        gate_up_scale / down_scale: weight-only quantized experts: ``gate_up`` / ``down`` as int8 or
            float8_e4m3fn codes and their fp32 scales, per output channel (``[E, N]``) or per ``bn x bk`` block
            (``[E, ceil(N / bn), ceil(K / bk)]``, as DeepSeek-V3's FP8 checkpoints store 128 x 128). The result is
            the experts over the dequantized weights (``codes * scale`` in ``x.dtype``); on CUDA the kernels read
            the codes and scale in registers (half or a quarter of the bytes a step reads).

    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    op = "moe_experts_routed"
    check_moe_args(op, x, gate_up, down, weights, ids, activation)
    V.dim_at_least_one(op, "gate_up", gate_up, 0, "num_experts (E)")  # down has the same E
    V.floating(op, "x", x)
    V.same_device(op, "x", x, gate_up=gate_up, down=down, weights=weights, ids=ids)
    check_expert_scales(op, x, "gate_up", gate_up, gate_up_scale)
    check_expert_scales(op, x, "down", down, down_scale)
    scales = {k: v for k, v in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)) if v is not None}
    if not weights.is_floating_point():
        raise TypeError(f"{op}: weights must be a floating tensor, got {weights.dtype}")
    if expert_offset is not None and (isinstance(expert_offset, bool) or not isinstance(expert_offset, int)
                                      or expert_offset < 0):
        raise ValueError(f"{op}: expert_offset must be an int >= 0 or None, got {expert_offset!r}")
    if lora is not None:
        if activation != "silu":
            raise ValueError(f"{op}: lora takes SiLU-gated experts only, got activation={activation!r}")
        _check_lora(op, lora, x, gate_up)
        return dispatch(op, x.device)(x, gate_up, down, weights, ids, expert_offset, lora=lora, **scales)
    act = {} if activation == "silu" else {"activation": activation}
    if expert_offset is None:
        return dispatch(op, x.device)(x, gate_up, down, weights, ids, **act, **scales)
    return dispatch(op, x.device)(x, gate_up, down, weights, ids, expert_offset, **act, **scales)


def _reference(x, gate_up, down, weights, ids, expert_offset=None, *, lora=None, activation="silu",
               gate_up_scale=None, down_scale=None):  # fmt: skip
    gate_up = dequantize_experts(gate_up, gate_up_scale, x.dtype)
    down = dequantize_experts(down, down_scale, x.dtype)
    if lora is None:
        return moe_experts_ref(x, gate_up, down, weights, ids, expert_offset, activation)
    return moe_experts_lora_ref(x, gate_up, down, weights, ids, lora, expert_offset)


register("moe_experts_routed", "reference", _reference)
