"""Which decoder layers stream under a GPU memory budget, and what streaming them costs.

What counts against ``gpu_budget_bytes`` (all of it weights; the KV cache, activations, CUDA-graph pools and
kernel workspaces do not count -- size the engine's KV pool separately, e.g. ``EngineConfig.kv_cache_bytes``):

- every parameter and buffer outside the decoder layers (embeddings, ``lm_head``, the final norm, the RoPE table),
  once per tensor (a tied ``lm_head`` is the embedding);
- the resident decoder layers, as stored;
- the staging ring: ``min(prefetch, streamed layers)`` slots, each the largest streamed layer's tensors packed
  into one flat byte buffer (each tensor 256-byte aligned).

The layers that stream are the last ones: the copies of the first streamed layers are issued when layer 0
starts, so they overlap the resident layers' compute. As few layers stream as the budget allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256  # bytes; every tensor of a packed layer starts at a multiple (kernels want 16-byte alignment)


def fmt_bytes(n: float) -> str:
    """``n`` bytes for people: ``16.06 GB``, ``436.2 MB``, ``12.3 kB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{int(n)} B"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to its last (its strides kept; stride-0 tensors count contiguous)."""
    if t.numel() == 0:
        return 0
    if 0 in t.stride():
        return t.numel() * t.element_size()
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` of a model family whose forward calls each decoder layer module (the Llama family:
    Llama, Mistral, Qwen2/3, SmolLM2, MoE-Llama). ``TypeError`` naming ``model`` otherwise."""
    from ..models.llama import LlamaForCausalLM

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(model, LlamaForCausalLM):
        # The wrapper must be called for the stream to run: a forward that reaches into a layer's submodules
        # (Mamba2 / Bamba blocks) would read a slot holding another layer's weights.
        raise TypeError(f"model: weight streaming needs a Llama-family model whose forward calls each decoder layer "
                        f"(model.model.layers), got {type(model).__name__}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError("model: no decoder layers (model.model.layers is missing or empty)")
    return layers


def layer_tensors(layer: nn.Module) -> list[tuple[torch.Tensor, list[tuple[nn.Module, str, bool]]]]:
    """The distinct tensors of ``layer`` (parameters and buffers), each with every ``(module, name, is_param)``
    that holds it."""
    seen: dict[int, tuple[torch.Tensor, list]] = {}
    for mod in layer.modules():
        for name, t in mod._parameters.items():
            if t is not None:
                seen.setdefault(id(t), (t, []))[1].append((mod, name, True))
        for name, t in mod._buffers.items():
            if t is not None:
                seen.setdefault(id(t), (t, []))[1].append((mod, name, False))
    return list(seen.values())


def packed_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of one flat slot holding ``tensors``, each at a 256-byte aligned offset."""
    return sum(_align(span_bytes(t)) for t in tensors)


@dataclass(frozen=True)
class OffloadPlan:
    """Where a model's weights live under a GPU budget (see the module docstring for what counts)."""

    device: str
    gpu_budget_bytes: int
    prefetch: int
    num_layers: int
    streamed_layers: tuple[int, ...]
    always_resident_bytes: int  # outside the decoder layers
    resident_layer_bytes: int  # the resident decoder layers
    layer_bytes: tuple[int, ...]  # each decoder layer as stored
    packed_layer_bytes: tuple[int, ...]  # each streamed layer packed (what one copy moves), in layer order
    slot_bytes: int  # one staging slot (the largest streamed layer, packed); 0 when nothing streams
    num_slots: int

    @property
    def resident_layers(self) -> tuple[int, ...]:
        s = set(self.streamed_layers)
        return tuple(i for i in range(self.num_layers) if i not in s)

    @property
    def staging_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def streamed_bytes_per_forward(self) -> int:
        """Bytes copied host -> device by every forward (each streamed layer once, packed)."""
        return sum(self.packed_layer_bytes)

    @property
    def device_bytes(self) -> int:
        """Weights plus staging on the device: what is checked against ``gpu_budget_bytes``."""
        return self.always_resident_bytes + self.resident_layer_bytes + self.staging_bytes

    @property
    def all_resident_bytes(self) -> int:
        return self.always_resident_bytes + sum(self.layer_bytes)

    def __repr__(self) -> str:
        n, L = len(self.streamed_layers), self.num_layers
        head = (f"OffloadPlan(device={self.device}, budget {fmt_bytes(self.gpu_budget_bytes)}, "
                f"all-resident would need {fmt_bytes(self.all_resident_bytes)})")
        if not n:
            return head + f"\n  all {L} decoder layers resident: {fmt_bytes(self.device_bytes)}; nothing streams"
        first = self.streamed_layers[0]
        span = f"layers {first}..{self.streamed_layers[-1]}" if n > 1 else f"layer {first}"
        return (head +
                f"\n  resident: {L - n}/{L} decoder layers {fmt_bytes(self.resident_layer_bytes)} + embeddings, "
                f"lm_head, norms, buffers {fmt_bytes(self.always_resident_bytes)}"
                f"\n  streamed: {n}/{L} decoder layers ({span}), {fmt_bytes(self.streamed_bytes_per_forward)} "
                f"host->device per forward"
                f"\n  staging: {self.num_slots} slot(s) x {fmt_bytes(self.slot_bytes)} = "
                f"{fmt_bytes(self.staging_bytes)} (prefetch={self.prefetch})"
                f"\n  on the device: {fmt_bytes(self.device_bytes)} of {fmt_bytes(self.gpu_budget_bytes)}")


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    return v


def _check_rate(name: str, v, *, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a positive number, got {type(v).__name__}")
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}: expected a positive finite number, got {v}")
    return float(v)


def make_plan(model: nn.Module, gpu_budget_bytes: int, *, prefetch: int, device: torch.device) -> OffloadPlan:
    """The :class:`OffloadPlan` for ``model`` (not modified). Raises as :func:`offload_weights_` does."""
    layers = decoder_layers(model)
    if getattr(model, "offload_plan", None) is not None:
        raise ValueError("model: is already offloaded (model.offload_plan is set)")
    if getattr(model, "host_experts", None):
        raise ValueError("model: its experts are on the host (offload_experts_); weight streaming would copy them "
                         "back to the device")
    _check_int("gpu_budget_bytes", gpu_budget_bytes, 1)
    _check_int("prefetch", prefetch, 1)
    in_layers: set[int] = set()
    layer_bytes, packed = [], []
    for layer in layers:
        ts = [t for t, _ in layer_tensors(layer)]
        in_layers.update(id(t) for t in ts)
        layer_bytes.append(sum(_nbytes(t) for t in ts))
        packed.append(packed_bytes(ts))
    rest: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in in_layers:
            rest[id(t)] = t
    always = sum(_nbytes(t) for t in rest.values())
    L = len(layers)
    best = None
    for n in range(L + 1):  # stream the last n layers; the fewest that fit
        slots = min(prefetch, n)
        slot = max(packed[L - n:], default=0)
        need = always + sum(layer_bytes[: L - n]) + slots * slot
        best = need if best is None else min(best, need)
        if need <= gpu_budget_bytes:
            plan = OffloadPlan(device=str(device), gpu_budget_bytes=gpu_budget_bytes, prefetch=prefetch, num_layers=L,
                               streamed_layers=tuple(range(L - n, L)), always_resident_bytes=always,
                               resident_layer_bytes=sum(layer_bytes[: L - n]), layer_bytes=tuple(layer_bytes),
                               packed_layer_bytes=tuple(packed[L - n:]), slot_bytes=slot if n else 0,
                               num_slots=slots)  # fmt: skip
            return plan
    raise ValueError(
        f"gpu_budget_bytes={gpu_budget_bytes} is too small: the embeddings, lm_head, norms and buffers take {always} "
        f"bytes and a staging ring of prefetch={prefetch} slot(s) of one decoder layer ({max(packed)} bytes) more; "
        f"at least {best} bytes are needed (a smaller prefetch needs less)")


@dataclass(frozen=True)
class OffloadCost:
    """:func:`plan_offload`'s estimate of one forward step (seconds) under the plan.

    ``compute_s``: the step with every layer resident (given as ``step_s``, or the roofline of the weight bytes read
    over ``hbm_bytes_per_s`` and ~2 FLOPs per weight element per token over ``flops_per_s``). ``copy_s``: the
    streamed bytes over ``h2d_bytes_per_s``. ``step_s``: a simulation of the pipeline as it runs (per-layer compute
    in proportion to the layer's bytes, copies serialized on one copy stream, a copy into a slot waiting for the
    compute that last read it, the first ``num_slots`` copies issued when layer 0 starts). ``serialized_s``:
    copy then compute, no overlap. ``hide_tokens``: the tokens per step from which compute takes as long as the
    copies (needs ``flops_per_s``), i.e. where streaming becomes nearly free."""

    plan: OffloadPlan
    h2d_bytes_per_s: float
    tokens_per_step: int
    compute_s: float
    copy_s: float
    step_s: float
    serialized_s: float
    hide_tokens: float | None

    @property
    def slowdown(self) -> float:
        """Offloaded step time over the all-resident step time (1.0: streaming is free)."""
        return self.step_s / self.compute_s

    @property
    def copy_bound(self) -> bool:
        return self.copy_s > self.compute_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def __repr__(self) -> str:
        p, ms = self.plan, 1e3
        lines = [f"OffloadCost({len(p.streamed_layers)}/{p.num_layers} layers stream, "
                 f"{self.tokens_per_step} token(s) per step)"]
        if not p.streamed_layers:
            lines.append(f"  everything fits the budget: no streaming, step ~{self.compute_s * ms:.3f} ms")
            return "\n".join(lines)
        lines.append(f"  copy {fmt_bytes(p.streamed_bytes_per_forward)} at {self.h2d_bytes_per_s / 1e9:.1f} GB/s = "
                     f"{self.copy_s * ms:.3f} ms vs all-resident compute {self.compute_s * ms:.3f} ms -> "
                     f"{'copy' if self.copy_bound else 'compute'}-bound")
        lines.append(f"  step ~{self.step_s * ms:.3f} ms overlapped ({self.serialized_s * ms:.3f} ms serialized), "
                     f"{self.slowdown:.2f}x the all-resident step, ~{self.tokens_per_s:.1f} tok/s")
        verdict = (f"  pays only when the model does not fit otherwise (all-resident needs "
                   f"{fmt_bytes(p.all_resident_bytes)} > budget {fmt_bytes(p.gpu_budget_bytes)})")
        if self.hide_tokens is not None:
            verdict += f"; the copies hide behind compute from ~{self.hide_tokens:.0f} tokens per step"
        lines.append(verdict)
        return "\n".join(lines)


def _read_bytes_and_flops(model: nn.Module) -> tuple[int, float]:
    """Bytes of weights a decode step reads -- every parameter and persistent buffer except an embedding table that
    only the lookup reads (a few rows; a tied ``lm_head`` reads it whole) -- and 2 FLOPs per weight of every linear
    (``in_features x out_features``) per token."""
    read: dict[int, torch.Tensor] = {}
    flops = 0.0
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            continue
        if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int):
            flops += 2.0 * m.in_features * m.out_features
        for t in m._parameters.values():
            if t is not None:
                read[id(t)] = t
        for name, t in m._buffers.items():
            if t is not None and name not in m._non_persistent_buffers_set:
                read[id(t)] = t
    return sum(_nbytes(t) for t in read.values()), flops


def simulate_step(plan: OffloadPlan, compute_s: float, h2d_bytes_per_s: float) -> float:
    """Seconds of one forward under ``plan``: layer compute in proportion to its bytes (the rest of
    ``compute_s`` after the last layer), copies on one stream in layer order, the copy of the ``k``-th
    streamed layer into slot ``k % num_slots`` after the compute of streamed layer ``k - num_slots``."""
    L = plan.num_layers
    total = plan.always_resident_bytes + sum(plan.layer_bytes)
    per_layer = [compute_s * b / total for b in plan.layer_bytes]
    tail = compute_s - sum(per_layer)
    streamed = {i: k for k, i in enumerate(plan.streamed_layers)}
    copies = [b / h2d_bytes_per_s for b in plan.packed_layer_bytes]
    n, slots = len(copies), plan.num_slots
    ready = [0.0] * n
    copy_free = 0.0
    for k in range(min(slots, n)):
        copy_free += copies[k]
        ready[k] = copy_free
    t = 0.0
    for i in range(L):
        k = streamed.get(i)
        if k is None:
            t += per_layer[i]
            continue
        t = max(t, ready[k]) + per_layer[i]
        if k + slots < n:
            copy_free = max(copy_free, t) + copies[k + slots]
            ready[k + slots] = copy_free
    return t + tail


def plan_offload(
    model: nn.Module,
    gpu_budget_bytes: int,
    *,
    h2d_bytes_per_s: float,
    prefetch: int = 2,
    step_s: float | None = None,
    hbm_bytes_per_s: float | None = None,
    flops_per_s: float | None = None,
    tokens_per_step: int = 1,
    device: torch.device | str | None = None,
) -> OffloadCost:
    """Plan ``model``'s offload under ``gpu_budget_bytes`` (as :func:`offload_weights_` would; the model is not
    modified) and estimate what a forward step of ``tokens_per_step`` tokens then costs.

    Args:
        h2d_bytes_per_s: host-to-device bandwidth from pinned memory (measure it: ~50 GB/s on PCIe 5 x16).
        step_s: the measured all-resident step time at this ``tokens_per_step``, if known. Otherwise it is
            estimated from ``hbm_bytes_per_s`` (decode reads every weight once per step) and, when given,
            ``flops_per_s`` (~2 FLOPs per weight element per token); one of ``step_s`` / ``hbm_bytes_per_s`` is
            required.

    Returns an :class:`OffloadCost` whose repr says whether the step is copy- or compute-bound, how much slower
    than all-resident it is, and from how many tokens per step the copies hide behind compute. Decode at small
    batch on a PCIe host is copy-bound by ~2 orders of magnitude (a byte over PCIe costs ~100x a byte read from
    HBM): weight streaming pays for decode only where the model does not fit at all; large prefill chunks hide it.
    """
    from ..devices import check_device

    dev = _model_device(model) if device is None else check_device(device)
    plan = make_plan(model, gpu_budget_bytes, prefetch=prefetch, device=dev)
    h2d = _check_rate("h2d_bytes_per_s", h2d_bytes_per_s)
    _check_int("tokens_per_step", tokens_per_step, 1)
    step = _check_rate("step_s", step_s, optional=True)
    hbm = _check_rate("hbm_bytes_per_s", hbm_bytes_per_s, optional=True)
    flops = _check_rate("flops_per_s", flops_per_s, optional=True)
    if step is None and hbm is None:
        raise ValueError("step_s / hbm_bytes_per_s: give the measured all-resident step time or the device's "
                         "memory bandwidth to estimate it from")
    read, flops_per_token = _read_bytes_and_flops(model)
    if step is None:
        step = read / hbm
        if flops is not None:
            step = max(step, tokens_per_step * flops_per_token / flops)
    copy = plan.streamed_bytes_per_forward / h2d
    hide = None
    if flops is not None and plan.streamed_layers:
        hide = copy * flops / flops_per_token
    return OffloadCost(plan=plan, h2d_bytes_per_s=h2d, tokens_per_step=tokens_per_step, compute_s=step, copy_s=copy,
                       step_s=simulate_step(plan, step, h2d), serialized_s=step + copy, hide_tokens=hide)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError("model: has no parameters")
    return p.device
