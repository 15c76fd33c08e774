"""Multi-LoRA serving (Punica / S-LoRA style): each token of a batch runs the base model plus its own adapter.

:func:`enable_lora_` wraps every attention and MLP projection of a model's decoder layers in a :class:`LoRALinear`
with ``max_loras`` slots of stacked adapter weights, and returns the model's :class:`LoRAManager`. Before each
forward the caller gives the manager the adapter slot of every token (:meth:`LoRAManager.set_tokens`, -1 = the base
model); each wrapped projection then adds ``B[slot] @ (A[slot] @ x)`` to its base output:

- on a GPU, decode-sized steps (and CUDA graphs, which read the slots from a persistent device buffer) run the
  batched shrink / expand kernels (``ops.lora_shrink`` / ``ops.lora_expand_``: one adapter per token, BGMV);
- on the CPU, steps of up to ``BATCHED_MAX_TOKENS`` tokens run one native call per projection
  (``cpu_native.lora_apply_``: both halves, each token's own adapter, fp32 slots);
- larger eager steps group the tokens by adapter and run two GEMMs per adapter present.

Merged projections keep one slice per Hugging Face module: ``qkv_proj`` stacks the ``q_proj`` / ``k_proj`` /
``v_proj`` A matrices (``[3r, in]``) and gives each output column the B of its slice; ``gate_up_proj`` likewise for
``gate_proj`` / ``up_proj``. A slot an adapter does not fill (a projection it does not target, ranks below
``max_rank``) holds zeros.

On a tensor-parallel model (:func:`~infercore.parallel.tensor_parallel_` first, then :func:`enable_lora_`) each rank's
slots hold its slice of every adapter, cut as the base weight is (Punica / vLLM's layout), when the adapter is copied
into a slot; the host keeps the whole adapter, so the slot table and prefix-cache salt are the same on every rank:

- column-parallel (``qkv_proj``, ``gate_up_proj``): A whole (every rank needs the whole shrink), B the rank's rows of
  each slice (the rank's query heads, KV heads, gate and up rows: each slice split in rank order, as tensor.py does);
- row-parallel (``o_proj``, ``down_proj``): A the rank's input columns, B whole; the :class:`LoRALinear` sits inside
  :class:`~infercore.parallel.tensor.RowParallel`, so ``x_i A_i^T B^T`` joins the rank's partial output before the
  group's sum, and ``sum_i x_i A_i^T B^T = x A^T B^T``: no collective of its own.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from ..ops import lora_expand_, lora_shrink
from .adapter import LoRAAdapter

# tokens up to which an eager step takes the batched kernels rather than per-adapter GEMMs
BATCHED_MAX_TOKENS = 64

# our merged projection -> the Hugging Face modules of its slices, in output order
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# a sparse-MoE layer's routed experts, as adapters name their stacked pairs
EXPERT_SLICES = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
# the projections the fused CPU decoder layers add adapters to, in their operand table's order
_NATIVE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRALinear(nn.Module):
    """``base(x)`` plus the LoRA of each token's adapter slot (read from ``manager``).

    ``a``: ``[max_loras, n_slices * max_rank, in]``; ``b``: ``[max_loras, out, max_rank]`` (the scaling folded in);
    ``bounds``: the output column where each slice after the first begins. ``in_features`` / ``sizes`` are this
    rank's; ``shard`` (``"column"`` / ``"row"``, or None unsharded) with ``tp = (size, rank)`` says how a whole
    adapter's pair is cut for it (:meth:`shard_pair`)."""

    def __init__(self, base: nn.Module, manager: LoRAManager, slices: tuple[str, ...], sizes: tuple[int, ...],
                 in_features: int, *, device: torch.device, dtype: torch.dtype, shard: str | None = None,
                 tp: tuple[int, int] = (1, 0)) -> None:
        super().__init__()
        if shard not in (None, "column", "row"):
            raise ValueError(f"LoRALinear: shard must be None, 'column' or 'row', got {shard!r}")
        self.base = base
        self.slices, self.sizes = slices, sizes
        self.in_features, self.out_features = in_features, sum(sizes)
        self.shard, self.tp = (shard, tp) if tp[0] > 1 else (None, (1, 0))
        n = self.tp[0]
        # the whole model's shapes, which an adapter has
        self.full_in_features = in_features * (n if self.shard == "row" else 1)
        self.full_sizes = tuple(size * (n if self.shard == "column" else 1) for size in sizes)
        self.bounds = tuple(int(v) for v in np.cumsum(sizes)[:-1])
        S, r = manager.max_loras, manager.max_rank
        self.register_buffer("a", torch.zeros(S, len(slices) * r, in_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("b", torch.zeros(S, self.out_features, r, device=device, dtype=dtype), persistent=False)
        self.__dict__["manager"] = manager  # not a submodule: one manager serves every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        m = self.manager
        if not m.active:
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        groups = m.groups
        a, b = self.a, self.b
        hs = m.host_slots
        if hs is not None and x2.dtype in (torch.float32, torch.bfloat16) and y2.dtype == x2.dtype:
            return _native().lora_apply_(y2, x2.contiguous(), a, b, hs, self.bounds).view_as(y)
        if x2.dtype != a.dtype:  # the CPU keeps fp32 slots: its small bf16 GEMMs are slow
            x2 = x2.to(a.dtype)
        if groups is None:  # the batched kernels, one adapter per token
            T = x2.shape[0]
            idx, order = m.indices[:T], m.order[:T]
            lora_expand_(y2, lora_shrink(x2, a, idx, order=order), b, idx, slice_bounds=self.bounds, order=order)
            return y
        r = m.max_rank
        edges = tuple(zip((0, *self.bounds), (*self.bounds, self.out_features)))
        for slot, rows in groups:  # per adapter: a GEMM into the low rank, one per slice out of it
            xs = x2 if rows is None else x2.index_select(0, rows)
            s = xs @ a[slot].t()  # [n, n_slices * r]
            if rows is None and y2.dtype == b.dtype:  # every token: accumulate straight into y's slices
                for j, (lo, hi) in enumerate(edges):
                    y2[:, lo:hi].addmm_(s[:, j * r : (j + 1) * r], b[slot, lo:hi].t())
                continue
            d = torch.empty(len(xs), self.out_features, dtype=b.dtype, device=y2.device)
            for j, (lo, hi) in enumerate(edges):
                torch.mm(s[:, j * r : (j + 1) * r], b[slot, lo:hi].t(), out=d[:, lo:hi])
            if rows is None:
                y2.add_(d)
            else:
                y2.index_add_(0, rows, d.to(y2.dtype))
        return y

    @property
    def native_base(self) -> nn.Module:
        """The base linear, which the fused CPU decoder layers run (they add the adapters themselves, from
        :meth:`LoRAManager.native_operands`)."""
        return self.base

    def fit_pair(self, j: int, a: torch.Tensor, b: torch.Tensor, name: str, layer: int,
                 module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice ``j``'s whole pair checked against the model's shapes (ValueError naming the adapter) and cut to this
        rank's (:meth:`shard_pair`)."""
        if a.dim() != 2 or a.shape[1] != self.full_in_features or b.shape[0] != self.full_sizes[j]:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} / B "
                             f"{tuple(b.shape)}; this model's projection is [{self.full_sizes[j]}, "
                             f"{self.full_in_features}]")
        return self.shard_pair(j, a, b)

    def shard_pair(self, j: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of slice ``j``'s whole pair ``(A [r, full_in], B [full_size, r])`` (views): B's rows
        ``[rank * size, (rank + 1) * size)`` of a column-parallel projection, A's columns ``[rank * in, (rank + 1) *
        in)`` of a row-parallel one, the pair itself unsharded."""
        rank = self.tp[1]
        if self.shard == "column":
            size = self.sizes[j]
            return a, b[rank * size : (rank + 1) * size]
        if self.shard == "row":
            k = self.in_features
            return a[:, rank * k : (rank + 1) * k], b
        return a, b

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill ``slot`` with one ``(A [r, in], B [size, r])`` per slice (None: the slice is not targeted)."""
        r = self.manager.max_rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        lo = 0
        for j, (pair, size) in enumerate(zip(pairs, self.sizes)):
            if pair is not None:
                a, b = pair
                k = a.shape[0]
                self.a[slot, j * r : j * r + k].copy_(a)
                self.b[slot, lo : lo + size, :k].copy_(b)
            lo += size

    def extra_repr(self) -> str:
        tp = "" if self.shard is None else f", shard={self.shard}, tp={self.tp}"
        return (f"slices={self.slices}, in_features={self.in_features}, out_features={self.out_features}, "
                f"max_loras={self.a.shape[0]}, max_rank={self.manager.max_rank}{tp}")


class MoEExpertsLoRA(nn.Module):
    """The LoRA slots of one sparse-MoE layer's routed experts: slot ``s``'s adapter of expert ``e`` in row
    ``s * E + e`` of each stacked operand (:class:`~infercore.ops.moe.MoELoRA`'s layouts). Not a wrapper: the
    :class:`~infercore.models.moe.SparseMoeBlock` calls it in place of its experts while the manager is active, and
    it runs ``ops.moe_experts_routed(..., lora=)`` on the block's own expert weights."""

    slices = EXPERT_SLICES

    def __init__(self, block: nn.Module, manager: LoRAManager, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        E, two_i, H = block.experts.gate_up_proj.shape
        self.num_experts, self.hidden, self.inter = E, H, two_i // 2
        S, r = manager.max_loras, manager.max_rank
        for name, shape in (("a_gate_up", (S * E, 2 * r, H)), ("b_gate_up", (S * E, two_i, r)),
                            ("a_down", (S * E, r, self.inter)), ("b_down", (S * E, H, r))):
            self.register_buffer(name, torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        # 1 where the slot's adapter targets this layer's experts: the kernels skip the others' pairs (their rows
        # are zeros), so attention-only adapters read no expert LoRA weights inside the captured graphs
        self.register_buffer("live", torch.zeros(S, device=device, dtype=torch.int32), persistent=False)
        self.__dict__["manager"] = manager

    def fit_pair(self, j: int, a: torch.Tensor, b: torch.Tensor, name: str, layer: int,
                 module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice ``j``'s stacked pair ``(A [E', r, in], B [E', out, r])``, ``E' <= E``, checked against the experts'
        shapes."""
        k, n = (self.inter, self.hidden) if j == 2 else (self.hidden, self.inter)
        if a.dim() != 3 or a.shape[0] > self.num_experts or a.shape[2] != k or b.shape[1] != n:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} / B "
                             f"{tuple(b.shape)}; this model's experts take A [<= {self.num_experts}, r, {k}] and B "
                             f"[<= {self.num_experts}, {n}, r]")
        return a, b

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill ``slot`` with the gate's, the up projection's and the down projection's stacked pairs (None: not
        targeted; experts past an adapter's own count stay zero)."""
        E, r, inter = self.num_experts, self.manager.max_rank, self.inter
        rows = slice(slot * E, (slot + 1) * E)
        for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down):
            t[rows].zero_()
        self.live[slot] = int(any(p is not None for p in pairs))
        for j, pair in enumerate(pairs):
            if pair is None:
                continue
            a, b = pair
            n, k = a.shape[0], a.shape[1]
            base = slot * E
            if j == 2:
                self.a_down[base : base + n, :k].copy_(a)
                self.b_down[base : base + n, :, :k].copy_(b)
            else:
                self.a_gate_up[base : base + n, j * r : j * r + k].copy_(a)
                self.b_gate_up[base : base + n, j * inter : (j + 1) * inter, :k].copy_(b)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, expert_offset: int | None) -> torch.Tensor:
        from ..models.moe import moe_experts
        from ..ops.moe import MoELoRA

        slots = self.manager.token_slots(x.shape[0])
        lora = MoELoRA(self.a_gate_up, self.b_gate_up, self.a_down, self.b_down, slots, self.live)
        return moe_experts(x, gate_up, down, weights, ids, expert_offset, lora=lora)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.inter}, "
                f"max_loras={self.manager.max_loras}, max_rank={self.manager.max_rank}")


class LoRAManager:
    """The adapters of one model, its ``max_loras`` device slots, and the current step's token -> slot map.

    Any number of adapters can be registered (:meth:`add`; their weights stay on the host); at most ``max_loras``
    are in slots at once, each of rank up to ``max_rank``. A request takes its adapter's slot when admitted
    (:meth:`acquire`: the adapter is copied into a free slot, or into the least recently used one no running request
    holds) and gives it back when it finishes or is preempted (:meth:`release`). ``max_tokens`` bounds the tokens of
    a step that takes the batched kernels (the persistent ``indices`` buffer CUDA graphs read)."""

    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, *, device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        self.adapters: dict[str, LoRAAdapter] = {}  # registered, by name
        self.slots: dict[str, int] = {}  # adapter name -> slot, for the adapters in slots
        self.refs = [0] * max_loras  # running requests holding each slot
        self._owner: list[str | None] = [None] * max_loras
        self._used = [0] * max_loras  # when each slot was last given back (LRU among the idle ones)
        self._clock = 0
        self.loads = 0  # adapters copied into slots so far
        self.device = device
        self.indices = torch.full((max(max_tokens, 1),), -1, dtype=torch.int32, device=device)
        # the same tokens sorted by slot (stable), which the grouped kernels tile: sorted once a step on the host
        self.order = torch.arange(max(max_tokens, 1), dtype=torch.int64, device=device)
        self.active = False  # whether this step's forward applies LoRA at all
        # CPU steps of few tokens: each token's slot (int64, on the host) for the native kernel, else None
        self.host_slots: torch.Tensor | None = None
        # large eager steps: [(slot, token rows on the device, or None for every token)]
        self.groups: list[tuple[int, torch.Tensor | None]] | None = None
        # sparse-MoE layers' routed experts (MoEExpertsLoRA), which take every token's slot as a device tensor: on
        # large eager steps the slots copied for them (``step_slots``), else ``indices`` / ``host_slots``
        self.moe_layers = 0
        self.step_slots: torch.Tensor | None = None

    # ------------------------------------------------------------------ adapters

    def add(self, adapter: LoRAAdapter) -> None:
        """Register ``adapter`` (and copy it into a free slot, if one is); ValueError if the name is taken, its rank
        exceeds ``max_rank``, or it targets a layer / projection this model does not have or with shapes that do
        not match."""
        if not isinstance(adapter, LoRAAdapter):
            raise TypeError(f"adapter must be a LoRAAdapter, got {type(adapter).__name__}")
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank={self.max_rank}")
        self._place(adapter)  # checked now, not at the first request's admission
        adapter.fingerprint()
        self.adapters[adapter.name] = adapter
        if None in self._owner:
            self._load(adapter.name, self._owner.index(None))

    def remove(self, name: str) -> None:
        """Unregister ``name`` (ValueError if it is not registered, or a running request holds its slot)."""
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slots.get(name)
        if slot is not None:
            if self.refs[slot]:
                raise ValueError(f"LoRA adapter {name!r} is in use by {self.refs[slot]} running request(s)")
            del self.slots[name]
            self._owner[slot] = None
        del self.adapters[name]

    def acquire(self, name: str) -> int | None:
        """A slot holding adapter ``name`` for one more running request: its slot, or a free one, or the least
        recently used one no running request holds (the adapter is copied in); None when every slot is held."""
        slot = self.slots.get(name)
        if slot is None:
            idle = [s for s in range(self.max_loras) if self.refs[s] == 0]
            if not idle:
                return None
            slot = min(idle, key=lambda s: (self._owner[s] is not None, self._used[s]))
            old = self._owner[slot]
            if old is not None:
                del self.slots[old]
            self._load(name, slot)
        self.refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """One running request no longer holds ``slot``."""
        self.refs[slot] -= 1
        self._clock += 1
        self._used[slot] = self._clock

    def _load(self, name: str, slot: int) -> None:
        """Copy adapter ``name``'s weights into ``slot`` (every wrapped projection; zeros where it has none). The
        copies are queued on the current stream, after every step already launched (which may still read the
        slot's old adapter)."""
        per_layer = self._place(self.adapters[name])
        with torch.no_grad():
            for key, lin in self.layers.items():
                lin.set_slot(slot, per_layer.get(key) or [None] * len(lin.slices))  # copy_ casts
        self.slots[name] = slot
        self._owner[slot] = name
        self.loads += 1

    def salt(self, name: str) -> bytes:
        """The prefix-cache key of adapter ``name``'s requests: its weights' digest (the same adapter shares KV
        across names and engines; a different one under a reused name does not)."""
        return b"lora:" + self.adapters[name].fingerprint()

    def _place(self, adapter: LoRAAdapter) -> dict[tuple[int, str], list]:
        """The adapter's pairs by wrapped layer, slice by slice, checked against the whole model's shapes and cut to
        this rank's (:meth:`LoRALinear.shard_pair`) on a tensor-parallel model."""
        out: dict[tuple[int, str], list] = {}
        where = {}
        for (layer, ours), lin in self.layers.items():
            for j, hf in enumerate(lin.slices):
                where[(layer, hf)] = ((layer, ours), j)
        for (layer, module), (a, b) in adapter.weights.items():
            merged = self.layers.get((layer, module)) if module in MERGED else None
            if merged is not None and isinstance(merged, LoRALinear):
                # one pair over a merged projection (Phi-3's qkv_proj / gate_up_proj): A shared, B cut by slice
                if b.dim() != 2 or b.shape[0] != sum(merged.full_sizes):
                    raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} has B "
                                     f"{tuple(b.shape)}; this model's projection has {sum(merged.full_sizes)} rows")
                row = 0
                for j, size in enumerate(merged.full_sizes):
                    pairs = out.setdefault((layer, module), [None] * len(merged.slices))
                    if pairs[j] is not None:
                        raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {merged.slices[j]} is "
                                         f"targeted both alone and through {module}")
                    pairs[j] = merged.fit_pair(j, a, b[row : row + size], adapter.name, layer, module)
                    row += size
                continue
            hit = where.get((layer, module))
            if hit is None and module.startswith(("experts.", "shared_expert.")):
                raise ValueError(f"LoRA adapter {adapter.name!r} targets layer {layer} {module}: this model's layer "
                                 f"{layer} has no experts that take LoRA (routed experts take it only as dense tensors "
                                 "on the model's device, in a one-process model: not quantized, offloaded to the "
                                 "host, or tensor / expert parallel)")
            if hit is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} targets layer {layer} {module}, which this model "
                                 "does not have (or does not take LoRA on)")
            key, j = hit
            lin = self.layers[key]
            pairs = out.setdefault(key, [None] * len(lin.slices))
            if pairs[j] is not None:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} is targeted both alone and "
                                 "through its merged projection")
            pairs[j] = lin.fit_pair(j, a, b, adapter.name, layer, module)
        return out

    # ------------------------------------------------------------------ steps

    def set_tokens(self, slots: np.ndarray | list[int] | None) -> None:
        """The adapter slot of each token of the next eager forward (int, -1 = the base model), or None for none."""
        self.host_slots = None
        if slots is None:
            self.active, self.groups = False, None
            return
        slots = np.asarray(slots, dtype=np.int64)
        T = len(slots)
        if T == 0 or not (slots >= 0).any():
            self.active, self.groups = False, None
            return
        self.active = True
        if self.device.type == "cpu" and T <= BATCHED_MAX_TOKENS and _native().available():
            self.host_slots = torch.from_numpy(np.ascontiguousarray(slots))
        if T <= min(BATCHED_MAX_TOKENS, len(self.indices)) and self.device.type != "cpu":
            self.groups = None
            self.indices[:T].copy_(torch.from_numpy(slots.astype(np.int32)))
            self.order[:T].copy_(torch.from_numpy(np.argsort(slots, kind="stable")))
            return
        if self.moe_layers:  # the routed experts read every token's slot on the device
            self.step_slots = torch.from_numpy(slots).to(self.device, non_blocking=True)
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in np.unique(slots[slots >= 0]).tolist():
            rows = np.flatnonzero(slots == slot)
            groups.append((slot, None if len(rows) == T else torch.from_numpy(rows).to(self.device)))
        self.groups = groups

    def native_operands(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None | bool:
        """What the fused CPU decoder layers take for this step: None when no token has an adapter; ``(operands
        int64 [num_layers, cpu_native.LORA_TAB] (or the row of ``layer``), slots int64 [T])`` for a CPU step of
        the native kernel (:attr:`host_slots`); False otherwise (the layers then run op by op)."""
        if not self.active:
            return None
        if self.host_slots is None:
            return False
        tab = self.__dict__.get("_native_tab")
        if tab is None:
            layers = 1 + max(i for i, _ in self.layers)
            tab = torch.zeros(layers, _native().LORA_TAB, dtype=torch.int64)
            if any(attr not in _NATIVE for _, attr in self.layers):  # MoE layers run op by op
                return False
            for (i, attr), lin in self.layers.items():
                j = _NATIVE.index(attr)
                if lin.a.dtype != torch.float32 or not (lin.a.is_contiguous() and lin.b.is_contiguous()):
                    return False
                bounds = (*lin.bounds, lin.out_features, lin.out_features, lin.out_features)[:3]
                tab[i, 7 * j : 7 * j + 7] = torch.tensor([lin.a.data_ptr(), lin.b.data_ptr(), lin.a.shape[1],
                                                          self.max_rank, *bounds])
            self.__dict__["_native_tab"] = tab
        return (tab if layer is None else tab[layer]), self.host_slots

    def token_slots(self, T: int) -> torch.Tensor:
        """Every token's slot of this step (``T`` tokens), as a tensor on the model's device (the persistent
        ``indices`` under CUDA graphs)."""
        if self.host_slots is not None:
            return self.host_slots
        if self.groups is None:
            return self.indices[:T]
        return self.step_slots

    def capturing(self) -> None:
        """Before capturing decode graphs: LoRA on, through the batched kernels over the persistent buffer."""
        self.active, self.groups, self.host_slots = True, None, None


def _native():
    from ..ops.moe import cpu_native

    return cpu_native


def enable_lora_(model: nn.Module, *, max_loras: int = 4, max_rank: int = 16, max_tokens: int = 256) -> LoRAManager:
    """Wrap the decoder layers' attention (``qkv_proj``, ``o_proj``) and gated-MLP (``gate_up_proj``, ``down_proj``)
    projections of ``model`` in :class:`LoRALinear` (in place) and return its :class:`LoRAManager` (also kept as
    ``model.lora_manager``). Call it once, after the weights are loaded (quantized bases are fine), after
    :func:`~infercore.parallel.tensor_parallel_` on a sharded model (each rank's slots then hold its slice of every
    adapter; see the module docstring), and before device layouts (``Engine`` does this when ``max_loras > 0``).
    A sparse-MoE layer's routed experts get a :class:`MoEExpertsLoRA` (``S * E`` stacked rows per operand: mind the
    memory, ``max_loras * E * max_rank * (4 H + 3 I)`` values per layer) and its shared expert :class:`LoRALinear`
    wrappers, when its experts are dense tensors on the model's device and the model runs in one process.

    Raises ValueError (leaving the model as it was) for a model without such layers or whose family says
    ``lora_unsupported``, an already-enabled model, a sharded model whose row-parallel
    projections are not :class:`~infercore.parallel.tensor.RowParallel`, or bad limits."""
    for name, v in (("max_loras", max_loras), ("max_rank", max_rank), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"enable_lora_: {name} must be an int >= 1, got {v!r}")
    if getattr(model, "lora_manager", None) is not None:
        raise ValueError("enable_lora_: LoRA is already enabled on this model")
    reason = getattr(model, "lora_unsupported", None)  # a family's reason, checked before anything is wrapped
    if reason:
        raise ValueError(f"enable_lora_: {type(model).__name__}: {reason}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"enable_lora_: {type(model).__name__} has no model.layers")
    tp = (int(getattr(model, "tp_size", 1)), int(getattr(model, "tp_rank", 0)))
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if not dtype.is_floating_point or device.type == "cpu":  # the CPU's small GEMMs are fastest in fp32
        dtype = torch.float32
    manager = LoRAManager(max_loras, max_rank, max_tokens, device=device)
    wrap = functools.partial(_wrap, manager, device=device, dtype=dtype, tp=tp)
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        q_size, kv_size = getattr(attn, "q_size", None), getattr(attn, "kv_size", None)  # this rank's
        qkv = getattr(attn, "qkv_proj", None)
        if qkv is not None and q_size is not None and _out(qkv) == q_size + 2 * kv_size:
            _check_even_heads(model, attn, i, tp[0])
            wrap(attn, "qkv_proj", i, MERGED["qkv_proj"], (q_size, kv_size, kv_size), shard="column")
        if getattr(attn, "o_proj", None) is not None:
            wrap(attn, "o_proj", i, ("o_proj",), None, shard="row")
        gu = getattr(mlp, "gate_up_proj", None)
        if isinstance(gu, nn.Module) and getattr(mlp, "down_proj", None) is not None:
            half = _out(gu) // 2
            _unfuse(mlp)
            wrap(mlp, "gate_up_proj", i, MERGED["gate_up_proj"], (half, half), shard="column")
            wrap(mlp, "down_proj", i, ("down_proj",), None, shard="row")
        elif _lora_experts(mlp, tp[0]):
            lin = MoEExpertsLoRA(mlp, manager, device=device, dtype=dtype)
            mlp.experts_lora = lin
            manager.layers[(i, "experts")] = lin
            manager.moe_layers += 1
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                half = _out(shared.gate_up_proj) // 2
                wrap(shared, "gate_up_proj", i, ("shared_expert.gate_proj", "shared_expert.up_proj"), (half, half),
                     shard="column", key="shared_expert.gate_up_proj")
                wrap(shared, "down_proj", i, ("shared_expert.down_proj",), None, shard="row",
                     key="shared_expert.down_proj")
    if not manager.layers:
        raise ValueError(f"enable_lora_: {type(model).__name__} has no projections LoRA can target")
    model.lora_manager = manager
    return manager


def _check_even_heads(model: nn.Module, attn: nn.Module, layer: int, tp: int) -> None:
    """A sharded attention's heads must be an even split of the model's (each slice of B is cut so: KV heads
    replicated over ranks would need other rows)."""
    cfg = getattr(model, "config", None)
    want = (getattr(cfg, "num_heads", None), getattr(cfg, "num_kv_heads", None))
    if tp > 1 and None not in want and (attn.num_heads * tp, attn.num_kv_heads * tp) != want:
        raise ValueError(f"enable_lora_: layer {layer} holds {attn.num_heads} query / {attn.num_kv_heads} KV heads "
                         f"of {want[0]} / {want[1]} on each of {tp} ranks; LoRA needs them split evenly")


def _out(lin: nn.Module) -> int:
    n = getattr(lin, "out_features", None)
    if n is None:
        raise ValueError(f"enable_lora_: cannot tell the output size of {type(lin).__name__}")
    return int(n)


def _lora_experts(mlp: nn.Module, tp: int) -> bool:
    """Whether a sparse-MoE block's routed experts take LoRA: a block that runs them with the slots
    (``takes_experts_lora``: ``models.moe.SparseMoeBlock``), stacked floating expert tensors on the block's device
    (not int8 / fp8 codes, not offloaded to the host), one process (no tensor or expert parallelism). Other expert
    blocks (GPT-OSS's, in another layout) get no slots, so an adapter on their experts is refused when added."""
    experts = getattr(mlp, "experts", None)
    gu, d = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (tp == 1 and getattr(mlp, "takes_experts_lora", False) and type(gu) in (torch.Tensor, nn.Parameter)
            and type(d) in (torch.Tensor, nn.Parameter)
            and gu.is_floating_point() and gu.dim() == 3 and getattr(experts, "gate_up_scale", None) is None
            and getattr(mlp, "expert_offset", None) is None
            and getattr(mlp, "host_experts", None) is None and getattr(mlp, "top_k", None) is not None)


def _wrap(manager: LoRAManager, parent: nn.Module, attr: str, layer: int, slices, sizes, *, device, dtype,
          tp: tuple[int, int], shard: str, key: str | None = None) -> None:
    """Wrap ``parent.<attr>`` (``sizes`` None: one slice of its output size). On a sharded model a row-parallel
    projection's LoRA goes inside its ``RowParallel``, so that the adapter's partial output is summed with the base's
    (``manager.layers`` still names it ``attr``, or ``key``)."""
    key = (layer, key or attr)
    if tp[0] > 1 and shard == "row":
        from ..parallel.tensor import RowParallel

        if not isinstance(getattr(parent, attr), RowParallel):
            raise ValueError(f"enable_lora_: layer {layer} {attr} of this tensor-parallel model is not a RowParallel "
                             f"(found {type(getattr(parent, attr)).__name__}); shard it with tensor_parallel_")
        parent, attr = getattr(parent, attr), "linear"
    base = getattr(parent, attr)
    k = getattr(base, "in_features", None)
    if k is None:
        raise ValueError(f"enable_lora_: cannot tell the input size of {type(base).__name__}")
    sizes = (_out(base),) if sizes is None else sizes
    lin = LoRALinear(base, manager, tuple(slices), tuple(int(s) for s in sizes), int(k), device=device, dtype=dtype,
                     shard=shard, tp=tp)
    lin.layer_index = layer
    setattr(parent, attr, lin)
    manager.layers[key] = lin


def _unfuse(mlp: nn.Module) -> None:
    """An MLP whose class the CUDA layout swapped for its fused-GEMV form goes back to its own class (the fusion
    would bypass the LoRA of ``gate_up_proj``)."""
    from ..models.gpu_layout import _GemvFusedMLP

    if isinstance(mlp, _GemvFusedMLP):
        mlp.__class__ = next(c for c in type(mlp).__mro__[1:] if c is not _GemvFusedMLP and issubclass(c, nn.Module))
