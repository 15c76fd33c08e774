"""Device-specific weight layouts that keep the model's modules (and so quantization) unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        w = self.weight
        if x.device.type != "cpu" or x.dtype != w.dtype:
            return F.linear(x, w, self.bias)
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
    """Stacked routed experts (``gate_up [E, 2I, H]``, ``down [E, H, I]``) with each expert's two weights pre-packed
    for oneDNN, as :class:`CPUPackedLinear` packs a dense weight: a decode token's expert GEMVs then read near the
    memory bandwidth instead of the several times slower plain bf16 ``matmul``. ``__call__`` computes what
    ``ops.moe.naive.moe_experts_ref`` does, through ``ops.moe.naive.moe_experts_loop``.
    ``current(gate_up, down)`` says whether the packed copies still match the weights (same storage and version)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        with torch.no_grad():
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

        linear = torch.ops.mkldnn._linear_pointwise

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = silu_and_mul(linear(rows, self.gate_up[e], None, "none", [], ""))
            return linear(h, self.down[e], None, "none", [], "")

        return moe_experts_loop(x.contiguous(), weights, ids, expert_offset, len(self.gate_up), expert)


@torch.no_grad()
def pack_linears_for_cpu_(model: nn.Module) -> int:
    """Turn every CPU ``nn.Linear`` of ``model`` into a :class:`CPUPackedLinear`, and pack the routed experts of
    every CPU MoE block (:class:`CPUPackedExperts`, ``block.cpu_packed_experts``), in place, after the weights are
    loaded; returns how many linears and expert blocks were converted (0 where oneDNN cannot pack the dtype)."""
    from .moe import SparseMoeBlock

    n = 0
    for m in model.modules():
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
