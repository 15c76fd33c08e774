"""CUDA decode layout: ``nn.Linear`` modules that run a Triton skinny GEMV for few-row inputs.

At decode batch 1-16 every linear is a weight stream; ``ops.linear``'s Triton GEMV reads it closer
to the HBM bandwidth than cuBLAS on the shapes its tuning table covers. The swap keeps the plain
``weight``/``bias`` parameters (state dicts, quantization and ``load_weights`` see an ordinary
``nn.Linear``), mirroring :class:`infercore.models.layout.CPUPackedLinear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TritonGemvLinear(nn.Linear):
    """``nn.Linear`` whose CUDA forward takes the Triton GEMV when x has at most ``gemv_max_m``
    rows (leading dims flattened) and the tuning table measured it faster than cuBLAS for
    ``(N, K, M-bucket)``; otherwise ``F.linear``. The choice depends only on shapes, so it is
    made on the host without a sync and is CUDA-graph capturable (the GEMV allocates only its
    output, plus a split-K workspace from the same caching allocator)."""

    gemv_max_m: int = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        if 0 < m <= self.gemv_max_m and x.is_cuda and x.dtype == w.dtype and self._gemv_wins(m):
            return _triton().skinny_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)

    def _gemv_wins(self, m: int) -> bool:
        cache = self.__dict__.setdefault("_gemv_choice", {})
        hit = cache.get(m)
        if hit is None:
            n, k = self.weight.shape
            hit = cache[m] = _triton().beats_cublas(n, k, m)
        return hit


def _triton():
    from ..ops.linear import triton as gemv  # CUDA-only module: imported on first CUDA use

    return gemv


@torch.no_grad()
def use_triton_gemv_(model: nn.Module, *, max_m: int = 16) -> int:
    """Turn every CUDA ``nn.Linear`` of ``model`` into a :class:`TritonGemvLinear` (in place) that
    uses the GEMV for inputs of at most ``max_m`` rows; returns how many were converted."""
    if not isinstance(max_m, int) or isinstance(max_m, bool) or max_m < 0:
        raise ValueError(f"use_triton_gemv_: max_m must be an int >= 0, got {max_m!r}")
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.weight.device.type == "cuda":
            mod.__class__ = TritonGemvLinear
            mod.gemv_max_m = max_m
            n += 1
    return n
