"""Weights changed under a built engine: updates from a trainer between steps, and sleep mode.

What RL frameworks (verl, OpenRLHF, TRL) ask of an inference engine between training steps:

- :func:`plan_update` / :func:`apply_update_`: Hugging Face-named tensors (what ``model.load_weights`` takes, any
  subset of them) copied into the model's parameters *in place*. Checked whole first (names, shapes, quantized
  targets), then copied, so a refused update changes nothing. Parameters keep their tensors, so CUDA graphs captured
  over them stay valid. Derived copies are refreshed after the copy (:func:`refresh_derived_`).
- :class:`Stash`: the device storages :meth:`~infercore.engine.Engine.sleep` gives back (weights to host memory
  or discarded, the KV pool discarded), each tensor kept as an object over an emptied storage and grown back on
  wake-up (its address may change, so the engine captures its CUDA graphs again).

Where the device layouts keep derived copies of a weight, and what happens to them:

- ``models.gpu_layout`` (``TritonGemvLinear``, the fused gate_up GEMV MLPs): none; the kernels read the
  parameters themselves.
- ``models.layout.CPUPackedLinear``: oneDNN's packed copy, keyed by the weight's address and version; repacked.
- ``SparseMoeBlock.cpu_packed_experts`` (``CPUPackedExperts``): the native path reads the parameters, the oneDNN
  path packed copies, both keyed by address and version; rebuilt where stale.
- The fused native CPU decoder layers (``cpu_native.llama_decode_layer(s)``): raw pointers to the parameters,
  looked up again when an address changes; an in-place copy keeps them valid.
- ``quant.QuantLinear`` (``infercore.quant`` schemes, GGUF blocks, pre-quantized checkpoints): the weight exists
  only quantized (and repacked per kernel); an update that names one is refused (``ValueError``).
- Weight streaming (``offload.offload_weights_``), host-resident experts (``offload.offload_experts_``) and
  tensor-parallel shards: the parameters are not the whole weights in place; refused (``ValueError``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# what sleep may put to sleep, and wake_up(tags=) wake
SLEEP_TAGS = ("weights", "kv_cache")

_INV_FREQ = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass
class WeightWrite:
    """One checked tensor of an update: ``tensor`` lands in ``param[index]`` (``index`` None: the whole parameter;
    a slice of rows of a merged projection, an expert of a stacked expert tensor, or both)."""

    name: str  # as given (HF)
    param_name: str  # the model's parameter (a LoRA wrapper's ``base`` left out)
    param: nn.Parameter
    index: Any
    tensor: torch.Tensor

    @property
    def key(self) -> tuple[str, str]:
        return self.param_name, repr(self.index)


def check_in_place(model: nn.Module, what: str) -> None:
    """``ValueError`` where ``model``'s parameters are not its whole weights in device memory: tensor-parallel
    shards, layers streamed from host memory, routed experts kept in host memory."""
    from ..offload.streaming import OffloadedLayer

    if getattr(model, "tp_size", 1) > 1:
        raise ValueError(f"{what}: not on a tensor-parallel model (each rank holds a shard of the weights)")
    for name, m in model.named_modules():
        if isinstance(m, OffloadedLayer):
            raise ValueError(f"{what}: not on a model whose layers stream from host memory "
                             f"(offload.offload_weights_: {name})")
        if m.__dict__.get("host_experts"):  # a block's HostExperts, or the model's {layer: HostExperts}
            raise ValueError(f"{what}: not on a model whose routed experts live in host memory "
                             f"(offload.offload_experts_: {name or 'the model'})")


def model_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s parameters under the names its ``load_weights`` resolves HF names to: ``named_parameters()``
    (a tied one once), with the ``base`` of LoRA-wrapped projections (``lora.LoRALinear``) left out."""
    from ..lora.layers import LoRALinear

    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    out = {}
    for name, p in model.named_parameters():
        head, sep, tail = name.rpartition(".base.")
        out[f"{head}.{tail}" if sep and head in wrapped else name] = p
    return out


def _resolver(model: nn.Module):
    """``HF name -> (parameter name, index)`` by the model's own table: its ``_resolve`` (the families loaded
    through ``models.hybrid.load_hf_weights``), or the Llama family's ``_STACKED_RE`` / ``_STACKED`` /
    ``_shard_rows`` (q / k / v and gate / up rows of the merged projections, unless its checkpoints store them
    merged: ``_MERGED_CHECKPOINT``); else names are parameter names."""
    resolve = getattr(model, "_resolve", None)
    if callable(resolve):
        return resolve
    pattern, stacked = getattr(model, "_STACKED_RE", None), getattr(model, "_STACKED", None)
    rows = getattr(model, "_shard_rows", None)
    if pattern is None or stacked is None or rows is None or getattr(model, "_MERGED_CHECKPOINT", False):
        return lambda name: (name, None)

    def resolve_stacked(name: str) -> tuple[str, Any]:
        m = pattern.match(name)
        if m is None:
            return name, None
        prefix, proj, kind = m.groups()
        merged, shard = stacked[proj]
        return f"{prefix}{merged}.{kind}", slice(*rows(merged, shard))

    return resolve_stacked


def _ignored(model: nn.Module, name: str) -> bool:
    """Names ``load_weights`` skips: a tied ``lm_head.weight`` (the embedding matrix is written under its own
    name), RoPE's ``inv_freq``, and what the family's table skips (multimodal towers, MTP heads, ...)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and name.endswith("lm_head.weight"):
        return True
    if _INV_FREQ.search(name):
        return True
    for attr in ("_IGNORED_RE", "_IGNORED", "_SKIP"):
        pattern = getattr(type(model), attr, None)
        if isinstance(pattern, re.Pattern) and pattern.search(name):
            return True
    return False


def _refusal(model: nn.Module, name: str, resolve, modules: dict[str, nn.Module]) -> ValueError:
    """The error for ``name``, which resolves to no parameter: a quantized linear's weight, or an unknown name."""
    from ..quant.linear import QuantLinear

    for candidate in (name, f"model.{name}"):
        r = resolve(candidate)
        if r is None:
            continue
        path = r[0].rpartition(".")[0]
        mod = modules.get(path)
        mod = getattr(mod, "native_base", mod)  # a LoRA-wrapped projection: its base
        if isinstance(mod, QuantLinear):
            fmt = type(mod.qweight_format).__name__
            return ValueError(f"update_weights: {name!r} is the weight of {path}, a quantized linear ({fmt}); "
                              "quantized weights (infercore.quant schemes, GGUF blocks, pre-quantized checkpoints) "
                              "cannot take updates: build the engine from the dense model")
    arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
    return ValueError(f"update_weights: unknown tensor {name!r}: no parameter of {arch} takes it")


def plan_update(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                ) -> list[WeightWrite]:
    """Check an update of ``model`` by HF-named tensors (``(name, tensor)`` pairs as ``load_weights`` takes them,
    or a state-dict mapping), reading ``weights`` to its end; nothing is written. Any subset of the checkpoint's
    names will do. Raises ``ValueError`` naming the tensor for an unknown name, a quantized target, a shape that is
    not the parameter's (or its slice's), a tensor given twice, or (:func:`check_in_place`) a model whose
    parameters cannot take updates; ``TypeError`` for anything but str names and tensors."""
    check_in_place(model, "update_weights")
    if isinstance(weights, Mapping):
        weights = weights.items()
    params = model_parameters(model)
    resolve = _resolver(model)
    modules = dict(model.named_modules())
    plan: list[WeightWrite] = []
    seen: dict[tuple[str, str], str] = {}
    for item in weights:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str):
            raise TypeError(f"update_weights: a tensor's name must be a str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if _ignored(model, name):
            continue
        # a bare decoder's names (LlamaModel's, without "model."), as load_weights takes them
        r = next((r for r in map(resolve, (name, f"model.{name}")) if r is not None and r[0] in params), None)
        if r is None:
            raise _refusal(model, name, resolve, modules)
        pname, index = r
        param = params[pname]
        try:
            shape = param.shape if index is None else torch.empty(param.shape, device="meta")[index].shape
        except IndexError:  # e.g. an expert id past the model's expert count
            raise ValueError(f"update_weights: {name!r}: index {index} is out of range for {pname} "
                             f"{tuple(param.shape)}") from None
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}; {pname} takes "
                             f"{tuple(shape)} there")
        w = WeightWrite(name, pname, param, index, tensor)
        if w.key in seen:
            raise ValueError(f"update_weights: {name!r} writes what {seen[w.key]!r} writes ({pname}); given twice")
        seen[w.key] = name
        plan.append(w)
    return plan


@torch.no_grad()
def apply_update_(model: nn.Module, plan: list[WeightWrite]) -> None:
    """Copy ``plan``'s tensors into their parameters (cast to each one's dtype and device; the parameters keep
    their storage, so their addresses and CUDA graphs over them stay valid), then refresh the derived copies."""
    for w in plan:
        # through the parameter (not ``.data``), so its version counter moves: the packed copies key on it
        (w.param if w.index is None else w.param[w.index]).copy_(w.tensor)
    if plan and plan[0].param.is_cuda:
        torch.cuda.synchronize(plan[0].param.device)  # the caller may reuse its tensors at once
    refresh_derived_(model)


def refresh_derived_(model: nn.Module) -> int:
    """Rebuild the derived copies of weights written since they were made (see the module docstring): oneDNN's
    packed copy of each ``CPUPackedLinear`` and each MoE block's ``cpu_packed_experts``. Returns how many."""
    from ..models.layout import CPUPackedLinear
    from ..models.moe import SparseMoeBlock

    n = 0
    with torch.no_grad():
        for m in model.modules():
            if type(m) is CPUPackedLinear:
                w = m._parameters["weight"]
                if getattr(m, "_packed_key", None) != (w.data_ptr(), w._version):
                    m._pack()
                    n += 1
            elif isinstance(m, SparseMoeBlock) and m.cpu_packed_experts is not None:
                gu, dn = m.experts.gate_up_proj, m.experts.down_proj
                if not m.cpu_packed_experts.current(gu, dn):
                    m.cpu_packed_experts = type(m.cpu_packed_experts)(gu, dn)
                    n += 1
    return n


class Unwritten:
    """The parameters a level-2 sleep discarded that updates have not written whole yet (by element count over
    distinct targets: every HF name writes its own part of a parameter)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.left = {name: p.numel() for name, p in params.items()}
        self._seen: set[tuple[str, str]] = set()

    def __bool__(self) -> bool:
        return bool(self.left)

    def note(self, plan: list[WeightWrite]) -> None:
        for w in plan:
            if w.key in self._seen or w.param_name not in self.left:
                continue
            self._seen.add(w.key)
            self.left[w.param_name] -= w.tensor.numel()
            if self.left[w.param_name] <= 0:
                del self.left[w.param_name]


def frees_memory(device: torch.device) -> bool:
    """Whether sleep gives ``device``'s memory back (CUDA). On the CPU the tensors stay allocated: the KV pool is
    wiped (and at level 2 the weights), nothing moves."""
    return device.type == "cuda"


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct non-empty storage of ``tensors`` (views of one pool, tied weights: once)."""
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if st.nbytes() and key not in seen:
            seen.add(key)
            out.append(t)
    return out


def pool_tensors(pools) -> list[torch.Tensor]:
    """The tensors in ``pools`` (nested lists / tuples of KV caches, None skipped), quantized caches' scales
    (``kv.cache.QuantizedKVCache``) included."""
    out: list[torch.Tensor] = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
            if hasattr(x, "k_scale"):
                walk((x.k_scale, x.v_scale))

    walk(pools)
    return out


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (what a view of it does not cover included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class Stash:
    """Storages emptied by sleep: per storage, a tensor over it, its size, and its contents in host memory (pinned
    for a CUDA storage) or None (discarded: zeros come back). The tensors stay the same objects throughout, so
    everything holding them (modules, the KV cache lists, the CPU tier) needs nothing re-pointed; their data must
    not be touched until :meth:`restore` (an emptied storage has no memory behind it)."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        self._todo: list[tuple[torch.Tensor, bool]] = []

    def prepare(self, groups: list[tuple[list[torch.Tensor], bool]]) -> None:
        """Choose the storages of each ``(tensors, keep)`` group to empty, kept in host memory where ``keep`` (a
        storage in two groups goes with the first); nothing is freed yet. ``ValueError`` if one cannot be resized
        (memory-mapped or borrowed)."""
        seen = set()
        for tensors, keep in groups:
            for t in unique_storages(tensors):
                key = (t.device, t.untyped_storage().data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                if not t.untyped_storage().resizable():
                    raise ValueError(f"sleep: a tensor of shape {tuple(t.shape)} on {t.device} lives in memory that "
                                     "cannot be freed (memory-mapped or borrowed)")
                self._todo.append((t, keep))

    def release(self) -> None:
        """Empty the prepared storages (copied to host memory first where kept)."""
        for t, keep in self._todo:
            st = t.untyped_storage()
            n = st.nbytes()
            host = None
            if keep:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=t.is_cuda)
                host.copy_(storage_bytes(t))
            st.resize_(0)
            self._items.append((t, n, host))
        self._todo.clear()

    def restore(self) -> None:
        """Give every storage its memory back (perhaps at another address) and its contents (zeros where they were
        discarded)."""
        cuda = None
        for t, n, host in self._items:
            t.untyped_storage().resize_(n)
            b = storage_bytes(t)
            if host is None:
                b.zero_()
            else:
                b.copy_(host, non_blocking=True)
            cuda = t.device if t.is_cuda else cuda
        if cuda is not None:
            torch.cuda.synchronize(cuda)  # before the pinned copies go
        self._items.clear()
