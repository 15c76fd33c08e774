"""Routed experts computed on the host: MoE models whose experts do not fit the GPU.

A routed-expert model (Mixtral, Qwen2/3-MoE, Qwen3-Next) keeps nearly all of its weights in the experts, and a
decode step reads only the few each token is routed to. :func:`offload_experts_` moves the routed experts of
the chosen layers to host memory and runs them where they are (the design of Fiddler and KTransformers): per MoE
layer the router runs on the device, the hidden states and routing (``T x (H + 2k)`` values) cross to the host,
the host computes the routed experts with every core, and their sum crosses back. The shared expert (Qwen2-MoE,
Qwen3-Next) stays on the device and runs while the host computes.

At decode the host reads ``k`` experts per token (a Qwen3-30B-A3B-shaped layer: 8 x 9.4 MB), far less than
copying the layer's experts over PCIe (128 x 9.4 MB); a long prefill routes to nearly every expert and computes
far more per weight, where the host is slow and the copy is cheap per token. With ``device_min_tokens`` set, a
forward of at least that many tokens copies the layer's experts from plain page-locked host copies into one device
staging buffer and runs them there; by default the host keeps one copy, oneDNN-packed (or quantized), and runs
every forward's experts itself.

The host path synchronizes the host with the device once per offloaded layer, so a model with host experts is not
one CUDA graph (``model.host_synchronizing``). The :class:`~infercore.Engine` captures its decode as a chain of
graphs instead (``devices.graphs.capture_segmented``): each layer's host experts end one graph and start the next,
the inputs and result crossing through page-locked buffers fixed at capture (:meth:`HostExperts.reserve`).
On the CPU "host" and "device" are one and the same; the path is the same bookkeeping.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from ..ops.moe import cpu_native
from ..ops.moe.naive import check_moe_args, moe_experts_loop, moe_experts_ref
from .plan import _align
from .streaming import _pinned_host, _unregister, _view

# Decode batches route to a few experts each (the host reads only those); from about this many tokens a layer's
# experts are mostly all routed and the host's compute, not its memory, is the limit (a Qwen3-30B-A3B-shaped
# layer: 1.2 GB of experts, ~22 ms over 55 GB/s PCIe, vs ~0.08 ms of host compute per token at 1 TFLOP/s).
AUTO_DEVICE_MIN_TOKENS = 256


class _QuantLinear:
    """One expert weight quantized for the host: the packed CPU kernel's operands only (its codes repacked once,
    the :class:`~infercore.quant.formats.IntWeight` dropped) where the kernel takes the format and the model is
    bf16, else the ``IntWeight`` through ``quant.wq_matmul`` (the reference for other dtypes)."""

    def __init__(self, w: torch.Tensor, scheme: str, dtype: torch.dtype) -> None:
        from ..quant import cpu as qcpu
        from ..quant.api import quantize_weight

        q = quantize_weight(w, scheme).to("cpu")  # on w's device (fast on a GPU), then to the host
        self.kind = qcpu.cpu_kind(q) if dtype == torch.bfloat16 else None
        self.n = q.shape[0]
        pack = {"int4": cpu_native.pack_q4, "int8": cpu_native.pack_q8}.get(self.kind)
        native = pack(q) if pack is not None and cpu_native.q4_supported() else None
        if native is not None:  # (codes uint8 [N, Kp / 2] (INT4) or [N, Kp] (INT8), scales-and-zeros [N, 2, Kp / g])
            self.kind, self.ops = "native4" if self.kind == "int4" else "native8", native
            self.k = native[0].shape[1] * (2 if self.kind == "native4" else 1)
            self.nbytes = sum(t.numel() * t.element_size() for t in native)
        elif self.kind == "int4":  # (codes, group size, scales-and-zeros [K / group, N, 2])
            self.ops = qcpu.pack_int4(q)
            self.k = self.ops[2].shape[0] * self.ops[1]
            self.nbytes = sum(t.numel() * t.element_size() for t in (self.ops[0], self.ops[2]))
        elif self.kind == "int8":
            self.ops, self.k = qcpu.pack_int8(q), qcpu._int8_k(q)
            self.nbytes = sum(t.numel() * t.element_size() for t in self.ops)
        else:
            self.w = q
            self.nbytes = sum(t.numel() * t.element_size() for t in q.tensors().values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            from ..quant.ops import wq_matmul

            return wq_matmul(x, self.w)
        if self.kind in ("native4", "native8"):
            return (cpu_native.linear_q4 if self.kind == "native4" else cpu_native.linear_q8)(x, *self.ops)
        xp = torch.nn.functional.pad(x, (0, self.k - x.shape[1])) if self.k > x.shape[1] else x.contiguous()
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(xp, *self.ops)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xp, self.ops[0], self.ops[1], self.ops[2])


class NativeQuantExperts:
    """A layer's quantized experts (:class:`_QuantLinear` of kind ``"native4"``, INT4 in groups of 128, or
    ``"native8"``, INT8 per channel) stacked for the native kernel that runs all of a forward's routed experts in one
    call (``ops.moe.cpu_native.moe_experts_q4`` / ``moe_experts_q8``)."""

    def __init__(self, gate_up: list, down: list) -> None:
        self.kind = gate_up[0].kind
        self.gate_up = tuple(torch.stack([q.ops[i] for q in gate_up]) for i in range(2))
        self.down = tuple(torch.stack([q.ops[i] for q in down]) for i in range(2))
        self.nbytes = sum(t.numel() * t.element_size() for t in (*self.gate_up, *self.down))

    @classmethod
    def build(cls, gate_up: list, down: list) -> NativeQuantExperts | None:
        """The stacked experts, or None where the weights are not all native INT4 in groups of 128 or all native
        INT8, or a padded K would need padded rows (INT4: H and I multiples of 128)."""
        qs = (*gate_up, *down)
        kind = qs[0].kind
        if kind == "native4":
            ok = all(q.kind == kind and q.ops[1].shape[2] * cpu_native.Q4_GROUP == q.k for q in qs)
        else:
            ok = kind == "native8" and all(q.kind == kind for q in qs)
        if not ok:
            return None
        hidden, inter = gate_up[0].k, down[0].k
        if down[0].n != hidden or gate_up[0].n != 2 * inter:  # padded K: the rows would not line up
            return None
        return cls(gate_up, down)

    def __call__(self, x, weights, ids, expert_offset):
        fn = cpu_native.moe_experts_q4 if self.kind == "native4" else cpu_native.moe_experts_q8
        return fn(x, self.gate_up, self.down, weights, ids, expert_offset)


def _quant_experts(x, gate_up: list, down: list, weights, ids, expert_offset):
    """``moe_experts_ref`` over per-expert quantized weights (:class:`_QuantLinear`)."""
    from ..ops import silu_and_mul

    return moe_experts_loop(x, weights, ids, expert_offset, len(gate_up),
                            lambda e, rows: down[e](silu_and_mul(gate_up[e](rows))))


class HostExperts:
    """The routed experts of one :class:`~infercore.models.moe.SparseMoeBlock`, kept in host memory.

    Plain copies ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` (the block's own parameters, now host tensors in the
    page-locked region when the model runs on CUDA) feed the device staging copy; ``packed`` (a
    :class:`~infercore.models.layout.CPUPackedExperts`, where oneDNN packs the dtype) feeds the host GEMVs. Without
    staging only the packed copies are kept (the block's expert parameters become empty)."""

    def __init__(self, block: nn.Module, device: torch.device, staging: _Staging | None, device_min_tokens: int,
                 host: torch.Tensor | None = None, pack: bool = False, quantization: str | None = None) -> None:
        from ..models.layout import CPUPackedExperts

        self.device = device
        self.staging = staging
        self.device_min_tokens = device_min_tokens
        gu, dn = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        self.shapes = (tuple(gu.shape), tuple(dn.shape))
        self.dtype = gu.dtype
        self._meta = tuple(torch.empty(shape, dtype=gu.dtype, device="meta") for shape in self.shapes)
        self.packed = None
        self.quantized = None
        self.quant_bytes = 0
        self.native = None
        if quantization is not None:  # per expert, where the weights are; the host keeps the kernel operands
            self.quantized = ([_QuantLinear(gu[e], quantization, gu.dtype) for e in range(gu.shape[0])],
                              [_QuantLinear(dn[e], quantization, gu.dtype) for e in range(dn.shape[0])])
            self.quant_bytes = sum(q.nbytes for qs in self.quantized for q in qs)
            self.native = NativeQuantExperts.build(*self.quantized)
            if self.native is not None:  # the stacked copies are all that stay
                self.quantized = None
        elif pack:  # from a host copy of one block at a time: the packed copies are all that stay
            self.packed = CPUPackedExperts(gu.to("cpu"), dn.to("cpu"))
        keep_plain = staging is not None or not (pack or quantization is not None)
        off = 0
        for name, p in (("gate_up_proj", gu), ("down_proj", dn)):
            if not keep_plain:
                p = torch.empty(0, dtype=p.dtype)
            elif host is not None:  # a view of the (page-locked) host region, one copy straight into it
                view = _view(host, host.storage_offset() + off, p, _contiguous(p))  # _view: storage offsets
                view.copy_(p)
                p, off = view, off + _align(p.numel() * p.element_size())
            setattr(block.experts, name, nn.Parameter(p, requires_grad=False))
        self.gate_up = block.experts.gate_up_proj
        self.down = block.experts.down_proj
        self.top_k = block.top_k
        self.calls_host = 0
        self.calls_device = 0
        self._pinned: torch.Tensor | None = None  # page-locked exchange buffers of captured graphs (reserve)

    @property
    def nbytes(self) -> int:
        """Host bytes of the experts' copy the host computes with (quantized: codes and scales)."""
        return self.quant_bytes or sum(math.prod(s) for s in self.shapes) * self.dtype.itemsize

    def _host(self, x, weights, ids, expert_offset):
        check_moe_args("moe_experts", x, *self._meta, weights, ids)
        if self.native is not None and x.dtype == torch.bfloat16:
            return self.native(x, weights, ids, expert_offset)
        if self.quantized is not None:
            return _quant_experts(x, *self.quantized, weights, ids, expert_offset)
        if self.packed is not None and x.dtype == self.dtype:
            return self.packed(x, weights, ids, expert_offset)
        if not self.gate_up.numel():
            raise TypeError(f"moe_experts: x is {x.dtype}; the host experts are packed for {self.dtype} only")
        return moe_experts_ref(x, self.gate_up, self.down, weights, ids, expert_offset)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_offset: int | None,
                 overlap=None) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for ``x [T, H]``, ``weights / ids [T, k]``, as
        ``[T, H]`` in ``x.dtype`` on ``x``'s device (``ValueError`` / ``TypeError`` naming a bad one). ``overlap``: a
        callable enqueuing device work (the shared expert) to run while the host computes; its result is
        returned second when given."""
        if x.shape[0] >= self.device_min_tokens and self.staging is not None:
            self.calls_device += 1
            from ..models.moe import moe_experts

            gate_up, down = self.staging.load(self.gate_up, self.down)
            out = moe_experts(x, gate_up, down, weights, ids, expert_offset)
            return out if overlap is None else (out, overlap())
        if x.device.type == "cuda":
            from ..devices.graphs import segmented_capture_active

            if segmented_capture_active():
                return self._captured(x, weights, ids, expert_offset, overlap)
        self.calls_host += 1
        if x.device.type == "cpu":  # the whole model is on the host
            out = self._host(x, weights, ids, expert_offset)
            return out if overlap is None else (out, overlap())
        # The inputs go to page-locked buffers by copies enqueued first, then the overlapping device work; the host
        # waits only for the copies (their event), computes, and its result goes back as a copy the stream orders
        # after everything enqueued so far.
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (x, weights, ids)]
        for h, t in zip(host, (x, weights, ids)):
            h.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        side = overlap() if overlap is not None else None
        ready.synchronize()
        out = self._host(*host, expert_offset).to(x.device, non_blocking=True)
        return out if overlap is None else (out, side)

    def reserve(self, tokens: int) -> None:
        """Allocate what a captured forward of up to ``tokens`` tokens uses (page-locked exchange buffers, the
        device staging buffer where such a forward stages): allocations are not capturable."""
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"tokens must be an int, got {tokens!r}")
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        if self.staging is not None and tokens >= self.device_min_tokens and self.staging.buffer is None:
            self.staging.buffer = torch.empty(self.staging.nbytes, dtype=torch.uint8, device=self.device)
        hidden = self.shapes[0][2]
        nbytes = sum(_align(tokens * n * 8) for n in (hidden, self.top_k, self.top_k, hidden))  # any dtype <= 8 B
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _exchange(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        views, off = [], 0
        for shape, dtype in specs:
            n = math.prod(shape) * dtype.itemsize
            if self._pinned is None or off + n > self._pinned.numel():
                raise RuntimeError(f"HostExperts: a graph of {shape[0]} tokens is being captured; reserve(tokens) "
                                   "first (page-locked allocation is not capturable)")
            views.append(self._pinned[off : off + n].view(dtype).view(shape))
            off += _align(n)
        return views

    def _captured(self, x, weights, ids, expert_offset, overlap):
        """The host path inside a segmented CUDA-graph capture: the inputs' copies to fixed page-locked buffers and
        an event after them end this graph; at each replay the host waits for that event (not for the overlapping
        device work captured after it), computes into a fixed page-locked buffer, and the next graph starts by
        copying it back."""
        from ..devices.graphs import capture_event, host_break

        xh, wh, ih, oh = self._exchange((tuple(x.shape), x.dtype), (tuple(weights.shape), weights.dtype),
                                        (tuple(ids.shape), ids.dtype), (tuple(x.shape), x.dtype))
        for h, t in zip((xh, wh, ih), (x, weights, ids)):
            h.copy_(t, non_blocking=True)
        ready = capture_event()
        side = overlap() if overlap is not None else None

        def host() -> None:
            ready.synchronize()
            self.calls_host += 1
            oh.copy_(self._host(xh, wh, ih, expert_offset))

        host_break(host)
        out = torch.empty_like(x)
        out.copy_(oh, non_blocking=True)
        return out if overlap is None else (out, side)


def _contiguous(t: torch.Tensor) -> tuple[int, ...]:
    return torch.empty(t.shape, device="meta").stride()


def _expert_bytes(block: nn.Module) -> int:
    return sum(_align(p.numel() * p.element_size()) for p in (block.experts.gate_up_proj, block.experts.down_proj))


class _Staging:
    """One device buffer that holds the largest offloaded layer's experts; a layer's experts are copied into it
    on the current stream, so the kernels that read them (enqueued after) and the next layer's copy (enqueued
    after those) are ordered by the stream."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None  # allocated at the first long forward

    def load(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        out = []
        off = 0
        for t in (gate_up, down):
            view = _view(self.buffer, off, t, _contiguous(t))
            view.copy_(t, non_blocking=True)
            out.append(view)
            off += _align(t.numel() * t.element_size())
        return out[0], out[1]


def offload_experts_(
    model: nn.Module,
    *,
    layers: list[int] | int | None = None,
    device_min_tokens: int | None | str = "auto",
    num_threads: int | None = None,
    pack: bool | None = None,
    quantization: str | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """Keep the routed experts of a loaded MoE model's layers in host memory and compute them there, in place.
    Call it after loading (and sharding), before building the :class:`~infercore.Engine`: the KV pool is sized
    from the device memory left.

    Args:
        layers: decoder layer indices whose routed experts go to the host, or an int ``N``: the first ``N`` MoE
            layers (llama.cpp's ``--n-cpu-moe``: the other layers' experts stay on the device, using its spare
            memory). Default: every MoE layer.
        device_min_tokens: a forward of at least this many tokens copies the layer's experts to a device staging
            buffer (one layer's experts in size) and runs them there (from plain host copies); ``None``: always
            on the host; ``"auto"`` (default): ``None`` where the host copies are packed or quantized (one host
            copy), on the CPU, else 256 on CUDA.
        num_threads: host threads for the expert GEMMs (``torch.set_num_threads``; default: torch's).
        pack: keep the experts pre-packed for oneDNN (a decode GEMV through them reads about 2x faster than a plain
            bf16 ``matmul`` on x86). Default: where oneDNN packs the dtype and no staging threshold was given. With
            a staging threshold and ``pack=True`` the plain copies stay as well (two host copies); otherwise only
            the packed ones (the block's expert parameters become empty, and ``state_dict`` lacks them).
        quantization: a weight-only INT scheme of ``infercore.quant.SCHEMES`` (``"w4a16-g128"``, ``"w8a16"``, ...):
            each expert is quantized (round to nearest, where its weights are: fast on a GPU) and the host keeps
            only the packed CPU kernel's operands (INT4 g128: ~0.27 bytes per weight). bf16 models run the
            packed INT4 / INT8 kernels; other dtypes dequantize per call (the reference). Needs
            ``device_min_tokens=None`` (long forwards run on the host too) and excludes ``pack``.
        device: where the rest of the model runs (default: where its parameters are). A CPU model given
            ``device="cuda"`` has everything but the offloaded experts moved there.

    Returns a summary: ``{"layers": [...], "host_bytes": ..., "staging_bytes": ..., "packed": ...}`` (also
    ``model.host_experts``: layer index -> :class:`HostExperts`).

    Raises:
        TypeError: the model has no decoder layers, or ``layers`` / ``device_min_tokens`` / ``num_threads``
            are not ints.
        ValueError: no MoE layer to offload, a layer index out of range or not an MoE layer, the model is already
            offloaded, or ``device_min_tokens`` / ``num_threads`` < 1.
    """
    from ..devices import check_device
    from ..models.layout import cpu_packing_supported
    from ..models.moe import SparseMoeBlock

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(decoder, nn.ModuleList) or len(decoder) == 0:
        raise TypeError(f"model: no decoder layers (model.model.layers) in {type(model).__name__}")
    if getattr(model, "host_experts", None):
        raise ValueError("model: its experts are already offloaded")
    if getattr(model, "offload_plan", None) is not None:
        raise ValueError("model: weight streaming (offload_weights_) is on; offload the experts instead, or first")

    def moe_block(layer):  # a tensor-parallel layer's MLP is wrapped (parallel.RowParallel(linear=block))
        mlp = getattr(layer, "mlp", None)
        mlp = getattr(mlp, "linear", mlp)
        return mlp if isinstance(mlp, SparseMoeBlock) else None

    moe = [i for i, layer in enumerate(decoder) if moe_block(layer) is not None]
    if layers is None:
        layers = moe
    elif isinstance(layers, int) and not isinstance(layers, bool):
        if not 1 <= layers <= len(moe):
            raise ValueError(f"layers: {layers} MoE layers asked for, the model has {len(moe)} (1..{len(moe)})")
        layers = moe[:layers]
    else:
        if not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise TypeError(f"layers must be a list of ints or an int, got {layers!r}")
        for i in layers:
            if not 0 <= i < len(decoder):
                raise ValueError(f"layers: {i} is outside [0, {len(decoder)})")
            if i not in moe:
                raise ValueError(f"layers: layer {i} has no routed experts (MoE layers: {moe})")
        layers = sorted(set(layers))
    if not layers:
        raise ValueError("model: has no routed-expert (MoE) layer to offload")
    first = next(model.parameters())
    dev = check_device(device) if device is not None else first.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if pack is not None and not isinstance(pack, bool):
        raise TypeError(f"pack must be a bool or None, got {pack!r}")
    if pack and quantization is not None:
        raise ValueError("quantization: quantized host experts run the INT kernels; pack does not apply")
    blocks = [moe_block(decoder[i]) for i in layers]
    dtype = blocks[0].experts.gate_up_proj.dtype
    auto = isinstance(device_min_tokens, str) and device_min_tokens == "auto"
    if pack is None:  # packed where oneDNN can, unless that would make a second host copy the caller did not ask for
        pack = quantization is None and cpu_packing_supported(dtype) and (auto or device_min_tokens is None)
    elif pack and not cpu_packing_supported(dtype):
        raise ValueError(f"pack: oneDNN on this host cannot pack {dtype} weights")
    if auto:  # one host copy: packed or quantized ones serve every forward; plain ones stage long forwards
        device_min_tokens = AUTO_DEVICE_MIN_TOKENS if dev.type == "cuda" and not pack and quantization is None else None
    bad_min = isinstance(device_min_tokens, bool) or not isinstance(device_min_tokens, int)
    if device_min_tokens is not None and bad_min:
        raise TypeError(f"device_min_tokens must be an int or None, got {device_min_tokens!r}")
    if device_min_tokens is not None and device_min_tokens < 1:
        raise ValueError(f"device_min_tokens must be >= 1, got {device_min_tokens}")
    if quantization is not None:
        from ..quant.api import _resolve

        scheme = _resolve(quantization)  # TypeError / ValueError naming an unknown one
        if scheme.weight not in ("int4", "int8") or scheme.method != "rtn":
            raise ValueError(f"quantization: host experts take a weight-only INT scheme quantized by rounding "
                             f"(e.g. w4a16-g128, w8a16), got {scheme.name!r}")
        if device_min_tokens is not None:
            raise ValueError("quantization: quantized host experts have no device copy to stage; pass "
                             "device_min_tokens=None")
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int):
            raise TypeError(f"num_threads must be an int, got {num_threads!r}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    sizes = [_expert_bytes(b) for b in blocks]
    staging = _Staging(dev, max(sizes)) if device_min_tokens is not None else None
    # One host region for all of them: page-locked with cudaHostRegister when the model runs on CUDA (pin_memory=True
    # would round each tensor up to a power of two); a CPU model's experts stay where they are.
    host_all, registered = None, False
    keep_plain = staging is not None or not (pack or quantization is not None)  # else packed / quantized only
    if keep_plain and dev.type == "cuda":
        host_all, registered = _pinned_host(sum(sizes))
    elif keep_plain and any(p.device.type != "cpu" for b in blocks for p in b.experts.parameters()):
        host_all = torch.empty(sum(sizes), dtype=torch.uint8)
    offloaded = {}
    base = 0
    for i, block, size in zip(layers, blocks, sizes):
        region = host_all[base : base + size] if host_all is not None else None
        offloaded[i] = HostExperts(block, dev, staging, device_min_tokens or 0, region, pack=pack,
                                   quantization=quantization)
        block.host_experts = offloaded[i]
        base += size
    if registered:
        weakref.finalize(offloaded[layers[0]], _unregister, host_all.data_ptr())
    # Everything else goes to (or stays on) the device; tied parameters stay tied (set in place, as .to() does).
    host_ids = {id(h.gate_up) for h in offloaded.values()} | {id(h.down) for h in offloaded.values()}
    model._apply(lambda t: t if id(t) in host_ids else t.to(dev))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    model.host_experts = offloaded
    model.host_synchronizing = dev.type == "cuda"
    return {
        "layers": list(layers),
        "host_bytes": sum(h.nbytes for h in offloaded.values()),
        "staging_bytes": staging.nbytes if staging is not None else 0,
        "packed": pack,
        "quantization": quantization,
    }


__all__ = ["HostExperts", "offload_experts_"]
