"""Arrival counters for kernels that finish split-K inside the kernel (the last program of a tile sums
the partials and resets its counter), shared by the weight-only kernels of ``triton_wo`` and
``triton_frag``."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``n`` (reset by the kernels after use).

    One buffer per device: launches on one stream are ordered, so they may share it. Allocate
    before CUDA-graph capture (the first decode call does) so the graph does not own it.
    """
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c
