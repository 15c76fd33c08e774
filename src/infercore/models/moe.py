"""Sparse mixture of experts: top-k routing and the expert computation, with a shared expert.

Experts are stored stacked, in HF transformers 5 layout: ``gate_up_proj [E, 2I, H]`` (gate rows
first, then up) and ``down_proj [E, H, I]``. Four implementations of the expert computation give
the same result:

* :func:`moe_experts_reference` -- loop over experts, gather each one's tokens (the spec; the HF
  ``Qwen3NextExperts`` loop).
* :func:`moe_experts_grouped` -- sort the (token, expert) pairs by expert and run one GEMM pair per
  active expert on a contiguous slice (one host sync for the group sizes). A benchmark peer; not
  dispatched (its per-expert loop measured 42-56 ms at 64-1024 tokens on the Qwen3-Next shape).
* :func:`moe_experts_dense` -- every expert on every token with two batched GEMMs, combined by a
  ``[T, E]`` routing matrix. No sync, static shapes; but it computes ``E / k`` times the routed
  work and reads every expert (kept as an alternative; not dispatched).
* ``ops.moe_experts_routed`` -- the routed op: on CUDA a Triton grouped GEMM over the pairs sorted
  by expert on the device (reads only the routed experts, computes only routed products, no host
  sync: CUDA-graph safe). Decode, and prefill in chunks of :func:`routed_chunk_rows`.

:func:`moe_experts` dispatches: the reference on the CPU, the routed op elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..devices import dispatch
from ..ops import moe_experts_routed, silu_and_mul
from ..ops.moe.naive import check_moe_args, moe_experts_ref

__all__ = [
    "SparseMoeBlock",
    "moe_experts",
    "moe_experts_dense",
    "moe_experts_grouped",
    "moe_experts_reference",
    "route_topk",
]

# The routed op serves accelerators in chunks of rows whose fp32 per-pair outputs (rows * k * H * 4 bytes) fit in
# ROUTED_CHUNK_BYTES, and at least ROUTED_MIN_CHUNK rows; ROUTED_MAX_TOKENS, when set, fixes the chunk instead. Long
# chunks keep the prefill GEMMs large: DeepSeek-V2-Lite's experts at 1024 rows ran at 195 TFLOP/s on an H100 against
# 275 at 4096 (results/h100/moe_prefill.json). The grouped form's per-expert loop measured 52.7 ms at 256 tokens vs
# the routed op's 0.82 ms (results/h200/moe.json, Qwen3-Next expert shape), so it is not dispatched on accelerators.
ROUTED_MAX_TOKENS: int | None = None
ROUTED_CHUNK_BYTES = 256 << 20
ROUTED_MIN_CHUNK = 1024


def routed_chunk_rows(top_k: int, hidden: int) -> int:
    """Rows per call of the routed op on accelerators (see ``ROUTED_CHUNK_BYTES``)."""
    if ROUTED_MAX_TOKENS is not None:
        return ROUTED_MAX_TOKENS
    return max(ROUTED_MIN_CHUNK, ROUTED_CHUNK_BYTES // (4 * max(top_k, 1) * max(hidden, 1)))


def route_topk(router_logits: torch.Tensor, *, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing (Qwen/Mixtral style).

    Args:
        router_logits: ``[T, E]`` any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: rescale the chosen probabilities to sum to 1 (HF ``norm_topk_prob``).

    Returns:
        ``(weights fp32 [T, top_k], expert ids int64 [T, top_k])``.
    """
    if router_logits.ndim != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be an int in [1, {router_logits.shape[1]}], got {top_k!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(x, gate_up, down, weights, ids) -> None:
    check_moe_args("moe_experts", x, gate_up, down, weights, ids)


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x @ gate_up.t()) @ down.t()


def moe_experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` with SiLU-gated experts, expert by expert.

    Args:
        x: ``[T, H]``; gate_up: ``[E, 2I, H]``; down: ``[E, H, I]`` (same dtype as x).
        weights: ``[T, k]`` (any float); ids: ``[T, k]`` integer expert ids.

    Returns:
        ``[T, H]`` in ``x.dtype`` (each expert's output is scaled in fp32, summed in x.dtype).
    """
    _check(x, gate_up, down, weights, ids)
    return moe_experts_ref(x, gate_up, down, weights, ids)


def moe_experts_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """As :func:`moe_experts_reference`, with the (token, expert) pairs sorted by expert so each
    active expert runs on one contiguous slice; one host sync reads the group sizes."""
    _check(x, gate_up, down, weights, ids)
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tok = order // k
    xs = x[tok]
    w = weights.reshape(-1)[order].float()
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start : start + n] = _expert(xs[start : start + n], gate_up[e], down[e])
            start += n
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, ys.float() * w[:, None])
    return out.to(x.dtype)


def moe_experts_dense(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """As :func:`moe_experts_reference`, computing every expert on every token (two batched GEMMs
    over ``[E, T, *]``) and combining with the ``[T, E]`` routing matrix. For small ``T * E``."""
    _check(x, gate_up, down, weights, ids)
    T, E = x.shape[0], gate_up.shape[0]
    combine = torch.zeros(T, E, dtype=x.dtype, device=x.device)
    combine.scatter_(1, ids.long(), weights.to(x.dtype))
    h = torch.bmm(x.unsqueeze(0).expand(E, -1, -1), gate_up.transpose(1, 2))  # [E, T, 2I]
    y = torch.bmm(silu_and_mul(h), down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", combine, y)


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    expert_offset: int | None = None, *, lora=None, activation: str = "silu",
    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch. CPU: the reference loop (it costs less than either batched form there).
    Accelerators: the routed op (``ops.moe_experts_routed``: on CUDA a Triton grouped GEMM over the
    pairs sorted by expert on the device -- only routed experts read and computed, no host sync),
    :func:`routed_chunk_rows` tokens at a time. ``expert_offset``: the tensors hold experts
    ``[expert_offset, expert_offset + E)`` of a larger set (expert parallelism); pairs routed elsewhere are skipped.
    ``lora``: multi-LoRA on the experts (``ops.moe.MoELoRA``), through ``ops.moe_experts_routed`` on every device.
    ``activation``: ``"silu"`` (gated) or ``"relu2"`` (ungated squared ReLU, ``gate_up`` the up rows ``[E, I, H]``).
    ``gate_up_scale`` / ``down_scale``: int8 / fp8 expert codes' scales (:meth:`StackedExperts.quantize_`); the CPU
    dequantizes them per call."""
    scales = {} if gate_up_scale is None and down_scale is None else {"gate_up_scale": gate_up_scale,
                                                                     "down_scale": down_scale}
    if lora is not None:
        return _routed_in_chunks(x, gate_up, down, weights, ids, expert_offset, lora=lora, scales=scales)
    if x.device.type == "cpu":
        if scales:
            from ..ops.moe.naive import check_expert_scales, dequantize_experts

            check_expert_scales("moe_experts", x, "gate_up", gate_up, gate_up_scale)
            check_expert_scales("moe_experts", x, "down", down, down_scale)
            gate_up = dequantize_experts(gate_up, gate_up_scale, x.dtype)
            down = dequantize_experts(down, down_scale, x.dtype)
        check_moe_args("moe_experts", x, gate_up, down, weights, ids, activation)
        return moe_experts_ref(x, gate_up, down, weights, ids, expert_offset, activation)
    return _routed_in_chunks(x, gate_up, down, weights, ids, expert_offset, activation=activation, scales=scales)


def _routed_in_chunks(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    expert_offset: int | None = None, lora=None, activation: str = "silu", scales: dict | None = None,
) -> torch.Tensor:
    T, R = x.shape[0], routed_chunk_rows(ids.shape[-1], x.shape[-1])
    act = ({} if activation == "silu" else {"activation": activation}) | (scales or {})
    if T <= R:
        return moe_experts_routed(x, gate_up, down, weights, ids, expert_offset=expert_offset, lora=lora, **act)
    check_moe_args("moe_experts", x, gate_up, down, weights, ids, activation)
    return torch.cat([moe_experts_routed(x[s : s + R], gate_up, down, weights[s : s + R], ids[s : s + R],
                                         expert_offset=expert_offset,
                                         lora=None if lora is None else replace(lora, slots=lora.slots[s : s + R]),
                                         **act)
                      for s in range(0, T, R)])  # fmt: skip


class StackedExperts(nn.Module):
    """Expert weights, HF transformers 5 names: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    :meth:`quantize_` makes them weight-only int8 / fp8 codes with fp32 scales (``gate_up_scale`` / ``down_scale``,
    None while unquantized), which :meth:`scales` hands to the routed op."""

    KINDS = ("int8", "fp8", "fp8-block")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype))
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    def scales(self) -> dict[str, torch.Tensor]:
        """``{"gate_up_scale": ..., "down_scale": ...}`` for quantized experts, else ``{}``."""
        if self.gate_up_scale is None:
            return {}
        return {"gate_up_scale": self.gate_up_scale, "down_scale": self.down_scale}

    @torch.no_grad()
    def quantize_(self, kind: str, block: int = 128) -> StackedExperts:
        """Weight-only quantization in place: ``"int8"`` (symmetric, per output channel), ``"fp8"`` (e4m3, per
        output channel) or ``"fp8-block"`` (e4m3, ``block x block`` scales). The codes replace the weights (a half
        of bf16's bytes); the experts then compute over ``codes * scale`` in the activations' dtype."""
        if kind not in self.KINDS:
            raise ValueError(f"kind: expected one of {self.KINDS}, got {kind!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block: expected a positive int, got {block!r}")
        if self.gate_up_scale is not None:
            raise ValueError("quantize_: the experts are quantized already")
        if not self.gate_up_proj.is_floating_point():
            raise TypeError(f"quantize_: expected floating expert weights, got {self.gate_up_proj.dtype}")
        for name in ("gate_up_proj", "down_proj"):
            codes, scale = quantize_expert_weights(getattr(self, name).detach(), kind, block)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            setattr(self, name.replace("_proj", "_scale"), scale)
        return self


def quantize_expert_weights(w: torch.Tensor, kind: str, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and fp32 scales of stacked expert weights ``w [E, N, K]`` (see :meth:`StackedExperts.quantize_`), one
    expert at a time (a transient of one expert in fp32); ``ops.moe.dequantize_experts(codes, scale, dtype)`` gives
    the weights they stand for."""
    E, N, K = w.shape
    if kind == "fp8-block":
        nb, kb = -(-N // block), -(-K // block)
        codes = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
        scale = torch.empty(E, nb, kb, dtype=torch.float32, device=w.device)
        for e in range(E):
            wf = w[e].float()
            pad = torch.nn.functional.pad(wf.abs(), (0, kb * block - K, 0, nb * block - N))
            scale[e] = pad.view(nb, block, kb, block).amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            full = scale[e].repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
            codes[e] = (wf / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return codes, scale
    top, dtype = (127.0, torch.int8) if kind == "int8" else (448.0, torch.float8_e4m3fn)
    codes = torch.empty(E, N, K, dtype=dtype, device=w.device)
    scale = torch.empty(E, N, dtype=torch.float32, device=w.device)
    for e in range(E):
        wf = w[e].float()
        scale[e] = wf.abs().amax(dim=1).clamp(min=1e-12) / top
        q = (wf / scale[e][:, None]).clamp(-top, top)
        codes[e] = (q.round() if kind == "int8" else q).to(dtype)
    return codes, scale


class GatedMLP(nn.Module):
    """SiLU-gated MLP with merged ``gate_up_proj`` (the shared expert, or a dense layer's MLP)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus an optional sigmoid-gated shared expert (Qwen2-MoE / Qwen3-Next).

    ``forward(x [T, H]) -> [T, H]``: ``sum_k p_k expert_k(x) + sigmoid(x . g) * shared(x)``.
    """

    # lora.enable_lora_ gives the experts adapter slots only in blocks that run them (``experts_lora`` in forward)
    takes_experts_lora = True

    def __init__(
        self,
        hidden: int,
        *,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int = 0,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        # Expert parallelism (parallel.tensor_parallel_(experts="ep")): this block holds the experts
        # [expert_offset, expert_offset + its count) and skips the pairs routed to the others.
        self.expert_offset: int | None = None
        # offload.offload_experts_: the routed experts live in host memory and run there (offload/host_experts.py)
        self.host_experts = None
        # models.layout.pack_linears_for_cpu_: oneDNN-packed copies of the experts for the CPU forward
        self.cpu_packed_experts = None
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = StackedExperts(num_experts, hidden, intermediate, dtype=dtype)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, dtype=dtype) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused launch on CUDA (ops.moe_route_topk); HF casts the routing weights to the activation dtype
        # before the experts scale by them.
        weights, ids = dispatch("moe_route_topk", x.device)(self.gate(x), top_k=self.top_k,
                                                            renormalize=self.renormalize, out_dtype=x.dtype)
        if self.host_experts is not None:
            return self._forward_host(x, weights, ids)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        scales = self.experts.scales()  # int8 / fp8 experts (StackedExperts.quantize_)
        packed = self.cpu_packed_experts
        lora = self.__dict__["_modules"].get("experts_lora")  # lora.enable_lora_: the experts' adapter slots
        if lora is not None and lora.manager.active:
            out = lora(x, weights, ids, gate_up, down, self.expert_offset)
        elif packed is not None and not scales and x.device.type == "cpu" and x.dtype == packed.dtype:
            if not packed.current(gate_up, down):  # the weights were written since packing
                packed = self.cpu_packed_experts = type(packed)(gate_up, down)
            out = packed(x, weights, ids, self.expert_offset)
        else:
            out = moe_experts(x, gate_up, down, weights, ids, self.expert_offset, **scales)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _forward_host(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # The shared expert is enqueued on the device after the inputs' copies to the host, so it runs while the
        # host computes the routed experts.
        if self.shared_expert is None:
            return self.host_experts(x, weights, ids, self.expert_offset)
        out, shared = self.host_experts(x, weights, ids, self.expert_offset, overlap=lambda: torch.sigmoid(
            self.shared_expert_gate(x)) * self.shared_expert(x))
        return out + shared
