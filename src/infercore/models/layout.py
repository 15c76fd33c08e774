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


@torch.no_grad()
def pack_linears_for_cpu_(model: nn.Module) -> int:
    """Turn every CPU ``nn.Linear`` of ``model`` into a :class:`CPUPackedLinear` (in place, after the
    weights are loaded); returns how many were converted (0 where oneDNN cannot pack the dtype)."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and cpu_packing_supported(m.weight.dtype):
            m.__class__ = CPUPackedLinear
            m._pack()
            n += 1
    return n
