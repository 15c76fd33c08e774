"""Reference multi-LoRA shrink / expand: one fp32 GEMM per adapter the batch uses.

Grouping the tokens by slot keeps memory at one adapter's fp32 copy (a gather ``a[indices]`` would
materialize ``[T, R, K]``), but reading the slots on the host synchronizes: not graph-capturable.
"""

from __future__ import annotations

import torch


def _slots(indices: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, token rows) for every non-negative slot in ``indices``."""
    return [(slot, (indices == slot).nonzero().squeeze(1)) for slot in indices.unique().tolist() if slot >= 0]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor, *,
                    order: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _slots(indices):
        out[rows] = x[rows].float() @ a[slot].float().T
    return out


def lora_expand_ref(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    *,
    slice_bounds: tuple[int, ...] = (),
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    N, r = b.shape[1], b.shape[2]
    edges = (0, *slice_bounds, N)
    for slot, rows in _slots(indices):
        acc = y[rows].float()
        for j, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            acc[:, lo:hi] += s[rows, j * r : (j + 1) * r] @ b[slot, lo:hi].float().T
        y[rows] = acc.to(y.dtype)
    return y
