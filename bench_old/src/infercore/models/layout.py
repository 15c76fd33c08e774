"""Device-specific weight layouts that keep the model's modules (and so quantization) unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to which a bf16 / fp32 CPUPackedLinear without bias runs the native GEMV (ops.moe.cpu_native: plain weight
# rows streamed by every core; bf16 ~1.3-2x oneDNN's packed GEMV at one row on a 2-core EPYC, fp32 ~1.25x); more
# rows take oneDNN's packed GEMM.
NATIVE_MAX_ROWS = 4
# Routed (token, expert) pairs per expert, on average, below which bf16 CPUPackedExperts run the native kernel
# rather than oneDNN's GEMMs on the plain weights (packed per call): a Qwen3-30B-A3B layer crosses over between 512
# and 1024 tokens, 32 and 64 pairs per expert (benchmarks/results/cpu/sweeps/cpu_moe_prefill.json's note).
NATIVE_MAX_PAIRS_PER_EXPERT = 32


def _native() -> bool:
    from ..ops.moe import cpu_native

    return cpu_native.available()


def _native_status() -> str:
    from ..ops.moe import cpu_native

    return cpu_native.status()


def _native_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from ..ops.moe.cpu_native import linear_dense

    if x.dim() == 2:
        return linear_dense(x, w)
    return linear_dense(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


class CPUPackedLinear(nn.Linear):
    """``nn.Linear`` whose CPU forward runs oneDNN on a weight pre-packed in oneDNN's blocked layout.

    On x86 CPUs a decode GEMV through the packed weight reads memory closer to the bandwidth limit
    than ``F.linear`` does (benchmarks/bench_cpu_decode.py shows the end-to-end effect).
    ``weight`` stays the plain ``[out, in]`` parameter (state dicts, quantization and
    ``load_weights`` see an ordinary ``nn.Linear``); the packed copy is rebuilt whenever the
    weight is written in place. Inputs on other devices take ``F.linear``.
    """

    def _pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._packed_key = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]  # (not through nn.Module.__getattr__: this runs ~100 times a CPU token)
        if x.device.type != "cpu" or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
        b = self._parameters["bias"]
        if (x.numel() <= NATIVE_MAX_ROWS * w.shape[1] and w.is_contiguous() and _native()
                and x.dtype in (torch.bfloat16, torch.float32) and (b is None or b.dtype == x.dtype)):
            # decode rows: the native GEMV over the plain weight (a bias added to its rounded output in fp32, then
            # rounded: what the fused decoder layers do, cpu_kernels.c)
            y = _native_linear(x, w)
            return y if b is None else (y.float() + b.float()).to(x.dtype)
        if getattr(self, "_packed_key", None) != (w.data_ptr(), w._version):
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self.bias, "none", [], "")


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU build can prepack ``nn.Linear`` weights of ``dtype`` for oneDNN (fp32 always
    when mkldnn is built in; bf16 only where the CPU has bf16 support)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class CPUPackedExperts:
    """Stacked routed experts (``gate_up [E, 2I, H]``, ``down [E, H, I]``) prepared for host GEMVs. bf16 experts,
    where the native host kernels build (``ops.moe.cpu_native``), stay in their plain layout (no second copy) and
    a layer's routed experts run in one native call (~2x oneDNN's packed GEMVs on a 2-core EPYC, near the host's
    read bandwidth). Otherwise each expert's two weights are pre-packed for oneDNN, as :class:`CPUPackedLinear`
    packs a dense weight, and the experts run through ``ops.moe.naive.moe_experts_loop``; either reads several
    times faster than the plain bf16 ``matmul``. ``__call__`` computes what ``ops.moe.naive.moe_experts_ref``
    does. ``current(gate_up, down)`` says whether the prepared copies still match the weights (same storage and
    version)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, native: bool | None = None) -> None:
        """``native``: None picks the native kernels where they apply; False keeps oneDNN's packed copies;
        True requires the native kernels (``ValueError`` where they do not apply)."""
        from ..ops.moe.naive import check_moe_args

        for name, t in (("gate_up", gate_up), ("down", down)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"CPUPackedExperts: {name} must be a torch.Tensor, got {type(t).__name__}")
        if gate_up.ndim != 3 or down.ndim != 3:
            raise ValueError(f"CPUPackedExperts: gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} must be "
                             "[E, 2I, H] / [E, H, I]")
        E, _, H = gate_up.shape
        check_moe_args("CPUPackedExperts", torch.empty(0, H, device="meta"), gate_up, down,
                       torch.empty(0, 1, device="meta"), torch.empty(0, 1, dtype=torch.long, device="meta"))
        if gate_up.dtype != down.dtype:
            raise TypeError(f"CPUPackedExperts: gate_up is {gate_up.dtype} and down {down.dtype}; one dtype")
        if native is not None and not isinstance(native, bool):
            raise TypeError(f"native must be a bool or None, got {native!r}")
        can = gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu" and _native()
        if native and not can:
            raise ValueError(f"native: the native host kernels take bf16 CPU experts where they build (here: "
                             f"{gate_up.dtype} on {gate_up.device.type}; build {_native_status()})")
        self.native = can if native is None else native
        with torch.no_grad():
            if self.native:  # the plain weights themselves (a copy only where they are not contiguous)
                self.gate_up, self.down = gate_up.detach().contiguous(), down.detach().contiguous()
            else:
                reorder = torch.ops.mkldnn._reorder_linear_weight
                self.gate_up = [reorder(gate_up[e].detach().contiguous(), 1) for e in range(gate_up.shape[0])]
                self.down = [reorder(down[e].detach().contiguous(), 1) for e in range(down.shape[0])]
        self.key = self._key(gate_up, down)
        self.dtype = gate_up.dtype
        self._meta = (torch.empty(gate_up.shape, dtype=gate_up.dtype, device="meta"),
                      torch.empty(down.shape, dtype=down.dtype, device="meta"))

    @staticmethod
    def _key(gate_up: torch.Tensor, down: torch.Tensor) -> tuple:
        return gate_up.data_ptr(), gate_up._version, down.data_ptr(), down._version

    def current(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        return self.key == self._key(gate_up, down)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 expert_offset: int | None = None) -> torch.Tensor:  # fmt: skip
        """``x [T, H]`` (the packed dtype), ``weights / ids [T, k]`` -> ``[T, H]`` in ``x.dtype``."""
        from ..ops import silu_and_mul
        from ..ops.moe.naive import check_moe_args, moe_experts_loop

        check_moe_args("moe_experts", x, *self._meta, weights, ids)
        if x.dtype != self.dtype:
            raise TypeError(f"moe_experts: x is {x.dtype}; the experts are packed for {self.dtype}")
        num_experts = len(self.gate_up)
        if self.native and ids.numel() < NATIVE_MAX_PAIRS_PER_EXPERT * num_experts:
            from ..ops.moe.cpu_native import moe_experts_bf16

            return moe_experts_bf16(x, self.gate_up, self.down, weights, ids, expert_offset)
        if self.native:  # long prefills: oneDNN's GEMMs on the plain weights (packed per call) are faster there

            def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
                return F.linear(silu_and_mul(F.linear(rows, self.gate_up[e])), self.down[e])
        else:
            linear = torch.ops.mkldnn._linear_pointwise

            def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
                h = silu_and_mul(linear(rows, self.gate_up[e], None, "none", [], ""))
                return linear(h, self.down[e], None, "none", [], "")

        return moe_experts_loop(x.contiguous(), weights, ids, expert_offset, num_experts, expert)


@torch.no_grad()
def pack_linears_for_cpu_(model: nn.Module) -> int:
    """Turn every CPU ``nn.Linear`` of ``model`` into a :class:`CPUPackedLinear`, and pack the routed experts of
    every CPU MoE block (:class:`CPUPackedExperts`, ``block.cpu_packed_experts``), in place, after the weights are
    loaded; returns how many linears and expert blocks were converted (0 where oneDNN cannot pack the dtype). In a
    bf16 model, the native INT4 / INT8 operands of quantized linears (``quant.cpu.native_operands``) are made here
    too."""
    from ..quant.cpu import native_operands
    from ..quant.linear import QuantLinear
    from .moe import SparseMoeBlock

    n = 0
    first = next(model.parameters(), None)
    bf16 = first is not None and first.dtype == torch.bfloat16
    for m in model.modules():
        if type(m) is QuantLinear and bf16:  # the native INT4 / INT8 operands now, not in the first decode step
            native_operands(m.qweight_format)
            continue
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and cpu_packing_supported(m.weight.dtype):
            m.__class__ = CPUPackedLinear
            m._pack()
            n += 1
        elif isinstance(m, SparseMoeBlock) and m.host_experts is None:
            gu, dn = m.experts.gate_up_proj, m.experts.down_proj
            done = m.cpu_packed_experts is not None and m.cpu_packed_experts.current(gu, dn)
            if not done and gu.device.type == "cpu" and cpu_packing_supported(gu.dtype) and dn.dtype == gu.dtype:
                m.cpu_packed_experts = CPUPackedExperts(gu, dn)
                n += 1
    return n
