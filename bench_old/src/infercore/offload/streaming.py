"""Weight streaming: decoder layers whose weights live in host memory and are copied to the device just ahead of use.

:func:`offload_weights_` keeps as many whole decoder layers resident as the budget allows (see
:mod:`infercore.offload.plan` for what counts) and streams the rest. Each streamed layer's parameters and buffers
are packed into one flat host buffer (page-locked on CUDA), so bringing a layer over is one host-to-device copy,
into one of ``num_slots = min(prefetch, streamed)`` staging slots on the device: the ``k``-th streamed layer owns
slot ``k % num_slots`` for good, and its parameters / buffers *are* views into that slot (dtype, shape and strides
kept, each tensor 256-byte aligned), so the layer's own code, quantized kernels and device layouts run unchanged.

Every decoder layer is wrapped in an :class:`OffloadedLayer` (a wrapper module, as ``parallel.tensor`` wraps its
shards, rather than forward hooks: the wrapper is visible in the module tree, and a later module swap inside the
layer -- a device layout's class swap -- stays visible to it). Per forward:

- layer 0 starts the stream: an event recorded on the compute (current) stream, which the copy stream waits for
  (it joins a CUDA-graph capture there, and no copy overwrites a slot an earlier forward still reads), then the
  copies of the first ``num_slots`` streamed layers, each followed by its ``ready`` event;
- a streamed layer waits for its ``ready`` event on the compute stream before it runs;
- after streamed layer ``k`` has been enqueued, a ``freed`` event on the compute stream marks the end of its
  reads; the copy stream waits for it and copies streamed layer ``k + num_slots`` into the same slot.

The last copy is waited on by the last streamed layer, so every forward joins the copy stream back into the
compute stream: a forward is self-contained and CUDA-graph capturable (copies from page-locked memory and
cross-stream event waits are legal in a capture once the side stream has waited on an event of the capturing
stream). On the CPU "streaming" is a host-to-host copy into the slots with the same bookkeeping.

Limits: a streamed tensor must belong to its layer alone (shared with another layer or the resident part:
``ValueError``); MixQ ``QuantLinear`` s that grow their outlier set at run time replace their buffers and are
refused in streamed layers. Kernel repacks that :mod:`infercore.quant` caches per weight on first use (CPU packed
INT formats, GPU fragment layouts) are made from the slot while it holds the layer, so they are correct, but they
are device copies outside the budget. ``state_dict()`` of an offloaded model does not hold the streamed weights.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch import nn

from .plan import ALIGN, OffloadPlan, _align, decoder_layers, layer_tensors, make_plan, span_bytes


class OffloadedLayer(nn.Module):
    """Decoder layer ``index`` of an offloaded model: runs ``layer`` between the stream's bookkeeping. Attributes
    not found on the wrapper are looked up on ``layer`` (``self_attn``, ``mlp``, ...), so code that reads a layer's
    attributes sees the layer."""

    def __init__(self, layer: nn.Module, index: int, streamer: WeightStreamer) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self.streamer = streamer
        self.slot = streamer.slot_of(index)

    @property
    def streamed(self) -> bool:
        return self.slot is not None

    def forward(self, *args, **kwargs):
        s = self.streamer
        s.enter(self.index)
        out = self.layer(*args, **kwargs)
        s.exit(self.index)
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or "layer" not in modules:
                raise
            return getattr(modules["layer"], name)

    def extra_repr(self) -> str:
        return f"index={self.index}, " + (f"streamed through slot {self.slot}" if self.streamed else "resident")


class _HostCopier:
    """The CPU's copy "stream": with ``lazy`` a copy runs when its layer waits for it (in issue order, as a stream
    would), else at once. Tests run both: lazy copies expose a missing wait, eager ones a copy into a slot whose
    layer has not run yet."""

    lazy = False

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()

    def start(self) -> None:
        self.queue.clear()  # copies left by an interrupted forward; this one issues its own

    def copy(self, k: int, dst: torch.Tensor, src: torch.Tensor, after: int | None) -> None:
        if self.lazy:
            self.queue.append((k, dst, src))
        else:
            dst.copy_(src)

    def wait(self, k: int) -> None:
        while self.queue:
            j, dst, src = self.queue.popleft()
            dst.copy_(src)
            if j == k:
                return

    def finish(self) -> None:
        pass


class _CudaCopier:
    """A side copy stream and the events that order it against the compute (current) stream."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = [torch.cuda.Event() for _ in range(n)]
        self.freed = [torch.cuda.Event() for _ in range(n)]
        self.started, self.ended = torch.cuda.Event(), torch.cuda.Event()
        # Events are created on their first record: do it now, not inside a graph capture.
        for ev in (*self.ready, *self.freed, self.started, self.ended):
            ev.record(self.stream)
        self.stream.synchronize()
        self._ended = False
        self._compute = None

    def start(self) -> None:
        compute = self._compute = torch.cuda.current_stream(self.device)
        self.started.record(compute)
        self.stream.wait_event(self.started)
        # An eager forward on another stream than the last one: wait for the last one's reads of the slots too.
        # (Not inside a capture: an event recorded outside it cannot be waited on there.)
        if self._ended and not torch.cuda.is_current_stream_capturing():
            self.stream.wait_event(self.ended)

    def copy(self, k: int, dst: torch.Tensor, src: torch.Tensor, after: int | None) -> None:
        if after is not None:
            ev = self.freed[after]
            ev.record(self._compute)
            self.stream.wait_event(ev)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.ready[k].record(self.stream)

    def wait(self, k: int) -> None:
        self._compute.wait_event(self.ready[k])

    def finish(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            return  # a captured record could not be waited on by a later eager forward
        self.ended.record(self._compute)
        self._ended = True


class WeightStreamer:
    """The per-forward protocol over one model's streamed layers (see the module docstring)."""

    def __init__(self, plan: OffloadPlan, hosts: list[torch.Tensor], slots: list[torch.Tensor],
                 device: torch.device) -> None:  # fmt: skip
        self.plan = plan
        self.num_layers = plan.num_layers
        self.order = {layer: k for k, layer in enumerate(plan.streamed_layers)}
        self.n, self.num_slots = len(plan.streamed_layers), plan.num_slots
        self.hosts = hosts  # per streamed layer: its packed bytes in host memory
        self.slots = slots
        self.dst = [slots[k % self.num_slots][: h.numel()] for k, h in enumerate(hosts)]
        self.copier = _CudaCopier(device, self.n) if device.type == "cuda" else _HostCopier()
        self._next = 0
        self.forwards = 0
        self._bound: dict[int, tuple] = {}  # streamed layer index -> its tensors as bound to the slot

    def bind(self, layers: nn.ModuleList) -> None:
        """Remember which tensors each streamed layer holds now (its slot views), to notice a later swap."""
        self._layers = list(layers)
        self._bound = {i: _holdings(layers[i]) for i in self.order}

    def slot_of(self, layer: int) -> int | None:
        k = self.order.get(layer)
        return None if k is None else k % self.num_slots

    def enter(self, i: int) -> None:
        if i == 0:
            self._next = 0
            self.forwards += 1
            if self.n:
                self.copier.start()
                for k in range(self.num_slots):
                    self.copier.copy(k, self.dst[k], self.hosts[k], None)
        if i != self._next:
            raise RuntimeError(f"offload: decoder layer {i} ran, expected layer {self._next}; a weight-streamed model "
                               f"runs its layers 0..{self.num_layers - 1} once per forward, in order")
        self._next = i + 1
        k = self.order.get(i)
        if k is not None:
            if _holdings(self._layers[i]) != self._bound[i]:
                raise RuntimeError(
                    f"offload: decoder layer {i} streams, but its modules or tensors changed after offload_weights_ "
                    "(quantize, tensor_parallel_, load_weights or .to() after offloading?); their new tensors are not "
                    "streamed. Offload last, on a model that is otherwise ready")
            self.copier.wait(k)

    def exit(self, i: int) -> None:
        k = self.order.get(i)
        if k is not None and k + self.num_slots < self.n:
            j = k + self.num_slots
            self.copier.copy(j, self.dst[j], self.hosts[j], k)
        if i == self.num_layers - 1 and self.n:
            self.copier.finish()


def _holdings(layer: nn.Module) -> tuple:
    """``(module, name, tensor)`` identities of every parameter / buffer under ``layer``: a module swapped in
    (quantization) or a tensor replaced after offloading changes it. A class swap (device layouts) does not."""
    return tuple((id(m), name, id(t)) for m in layer.modules()
                 for name, t in (*m._parameters.items(), *m._buffers.items()) if t is not None)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides, or contiguous ones where it has a stride-0 (expanded) dimension."""
    if t.numel() > 1 and 0 in t.stride():
        return torch.empty(t.shape, device="meta").stride()
    return t.stride()


def _view(buf: torch.Tensor, offset: int, t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``t``'s dtype / shape / ``stride`` at byte ``offset`` of the uint8 buffer ``buf``."""
    size = t.element_size()
    return buf.view(t.dtype).as_strided(t.shape, stride, offset // size)


def _pinned_host(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A host uint8 buffer of exactly ``nbytes``, page-locked with ``cudaHostRegister`` (as torch's checkpoint
    stager does: ``pin_memory=True`` would round a large allocation up to a power of two)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return buf, False
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1))  # cudaHostRegisterPortable
    if rc != 0:
        raise RuntimeError(f"offload_weights_: page-locking {nbytes} bytes of host memory failed (cudaError {rc})")
    return buf, True


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 -- at interpreter exit the runtime may be gone already
        pass


def _check_streamable(model: nn.Module, layers: nn.ModuleList, plan: OffloadPlan) -> None:
    if any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())):
        raise ValueError("model: has tensors on the meta device (materialise and load it first)")
    for i in plan.streamed_layers:
        for m in layers[i].modules():
            if getattr(m, "outlier_threshold", None) is not None:
                raise ValueError(f"model: decoder layer {i} would stream but holds a MixQ QuantLinear that grows "
                                 "its outlier set at run time (replacing its buffers); quantize without "
                                 "online outliers, or give a budget that keeps it resident")
    streamed_modules = {id(m) for i in plan.streamed_layers for m in layers[i].modules()}
    outside_ids, outside_mem = set(), set()
    for m in model.modules():
        if id(m) not in streamed_modules:
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    outside_ids.add(id(t))
                    outside_mem.add(t.untyped_storage().data_ptr())
    owner: dict[int, int] = {}
    for i in plan.streamed_layers:
        for t, refs in layer_tensors(layers[i]):
            mod, name, _ = refs[0]
            if id(t) in outside_ids or (t.numel() and t.untyped_storage().data_ptr() in outside_mem):
                raise ValueError(f"model: {type(mod).__name__}.{name} of decoder layer {i} shares memory with a "
                                 "tensor outside the streamed layers; a streamed layer's tensors must be its own")
            p = t.untyped_storage().data_ptr() if t.numel() else -id(t)
            if owner.setdefault(p, i) != i:
                raise ValueError(f"model: decoder layers {owner[p]} and {i} share a tensor's memory; a streamed "
                                 "layer's tensors must be its own")


def _set(refs, tensor: torch.Tensor) -> None:
    """Make every ``(module, name, is_param)`` of ``refs`` hold ``tensor`` (one Parameter object for all)."""
    param = None
    for mod, name, is_param in refs:
        if is_param:
            if param is None:
                param = nn.Parameter(tensor, requires_grad=False)
            mod._parameters[name] = param
        else:
            mod._buffers[name] = tensor


def _move_resident(model: nn.Module, skip: set[int], device: torch.device) -> None:
    """Move every parameter / buffer of ``model`` outside the modules ``skip`` (ids) to ``device``, keeping ties."""
    moved: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        if id(mod) in skip:
            continue
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in store.items():
                if t is None or t.device == device:
                    continue
                if id(t) not in moved:
                    new = t.detach().to(device)
                    moved[id(t)] = nn.Parameter(new, requires_grad=False) if is_param else new
                store[name] = moved[id(t)]


@torch.no_grad()
def offload_weights_(model: nn.Module, *, gpu_budget_bytes: int, prefetch: int = 2,
                     device: torch.device | str | None = None) -> OffloadPlan:  # fmt: skip
    """Stream decoder layers of a loaded Llama-family model from host memory so its weights fit
    ``gpu_budget_bytes`` on ``device``, in place. Call it last: after loading, quantizing and sharding, before
    building the :class:`~infercore.Engine` (its KV pool is sized from the memory left; set
    ``EngineConfig.kv_cache_bytes`` to bound it).

    Args:
        gpu_budget_bytes: device bytes for weights and the staging ring (see :mod:`infercore.offload.plan`).
        prefetch: staging slots, i.e. how many streamed layers may be on their way or in use at once (>= 1; 2
            overlaps the copy of layer ``i + 1`` with the compute of layer ``i``).
        device: where the model runs (default: where its parameters are). A CPU model given ``device="cuda"``
            has its resident part moved there; a CUDA model's streamed weights leave the device.

    Returns the :class:`OffloadPlan` (also ``model.offload_plan``; the streamer is ``model.offload_streamer``).
    Every decoder layer becomes an :class:`OffloadedLayer` (``model.model.layers[i].layer`` is the layer).

    Raises:
        TypeError: ``model`` is not a Llama-family model with decoder layers; a non-int budget / prefetch.
        ValueError: ``gpu_budget_bytes`` below the resident parts plus the staging ring (the minimum is named),
            ``prefetch < 1``, the model is already offloaded, or a streamed tensor is shared or not streamable.
    """
    from ..devices import check_device

    layers = decoder_layers(model)
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("model: has no parameters")
    dev = check_device(device) if device is not None else first.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: weight streaming runs on cpu or cuda, got {str(dev)!r}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    plan = make_plan(model, gpu_budget_bytes, prefetch=prefetch, device=dev)
    _check_streamable(model, layers, plan)
    streamed_modules = {id(m) for i in plan.streamed_layers for m in layers[i].modules()}
    _move_resident(model, streamed_modules, dev)

    # Pack each streamed layer into its host region, then point the layer at it (the device copies are freed).
    layouts = []
    offsets, total = [], 0
    for i in plan.streamed_layers:
        entries, off = [], 0
        for t, refs in layer_tensors(layers[i]):
            stride = _strides(t)
            entries.append((t, refs, off, stride))
            off += _align(span_bytes(t))
        layouts.append(entries)
        offsets.append(total)
        total += off
    pin = dev.type == "cuda"
    host_all, registered = _pinned_host(total) if pin else (torch.empty(total, dtype=torch.uint8), False)
    hosts = []
    for entries, base, size in zip(layouts, offsets, plan.packed_layer_bytes):
        host = host_all[base : base + size]
        for t, refs, off, stride in entries:
            if t.numel():
                view = _view(host_all, base + off, t, stride)
                view.copy_(t)
                _set(refs, view)
        hosts.append(host)
    for entries in layouts:
        entries.clear()  # drop the last references to the original tensors
    del layouts
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()

    slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(plan.num_slots)]
    for k, i in enumerate(plan.streamed_layers):
        slot, base = slots[k % plan.num_slots], offsets[k]
        for t, refs in layer_tensors(layers[i]):
            if t.numel():
                # t is now the host view: its byte offset inside this layer's region is where it goes in the slot
                off = (t.storage_offset() * t.element_size()) - base
                _set(refs, _view(slot, off, t, t.stride()))
            else:
                _set(refs, torch.empty(t.shape, dtype=t.dtype, device=dev))
    streamer = WeightStreamer(plan, hosts, slots, dev)
    streamer.bind(layers)
    if registered:
        weakref.finalize(streamer, _unregister, host_all.data_ptr())
    streamer.host = host_all
    for i in range(len(layers)):
        layers[i] = OffloadedLayer(layers[i], i, streamer)
    model.offload_plan = plan
    model.offload_streamer = streamer
    return plan


__all__ = ["ALIGN", "OffloadedLayer", "WeightStreamer", "offload_weights_"]
