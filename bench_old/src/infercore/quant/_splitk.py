"""Arrival counters for kernels that finish split-K inside the kernel (the last program of a tile sums
the partials and resets its counter), shared by the weight-only kernels of ``triton_wo`` and
``triton_frag``."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Buffers replaced by larger ones stay allocated: a CUDA graph captured before the replacement still reads and
# writes them on replay, so their memory must not return to the allocator.
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``n`` (reset by the kernels after use).

    One buffer per device: launches on one stream are ordered, so they may share it. Allocate
    before CUDA-graph capture (the first decode call does) so the graph does not own it.
    """
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        if c is not None:
            _RETIRED.append(c)
        c = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


_TAGGED: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def tagged_buffers(device: torch.device, blocks: int, split: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(epochs, partials)`` for the tagged split-K finish (``gluon_frag``'s ``_tag_finish``): int32 epochs, one
    per channel block, and int64 tagged partials ``[blocks, split, rows, 64]``, kept for the process.

    One pair per (device, split, rows): every launch that reads a slot rewrites it first with its own epoch, so a
    stale slot holds an older epoch. A block's epoch only grows (the launch's last program publishes it), and
    launches on one stream are ordered, so they may share the pair. Allocate before CUDA-graph capture (the
    first decode call does) so the graph does not own it; a larger ``blocks`` starts a new, zeroed pair (the old one
    stays allocated for graphs captured with it).
    """
    key = (device, split, rows)
    buf = _TAGGED.get(key)
    if buf is None or buf[0].numel() < blocks:
        if buf is not None:
            _RETIRED.extend(buf)
        cap = max(blocks, 512)
        buf = (torch.zeros(cap, dtype=torch.int32, device=device),
               torch.zeros(cap * split * rows * 64, dtype=torch.int64, device=device))
        _TAGGED[key] = buf
    return buf
