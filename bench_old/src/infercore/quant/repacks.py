"""Per-weight caches of kernel-specific repacks (GPU fragment / MODE 9 layouts, the CPU packed formats): made once
on the first call that needs them and dropped with the weight."""

from __future__ import annotations

import weakref

import torch

# id(qweight) -> (weak ref, {key: packed tensors}); entries leave with their qweight.
_PACKS: dict[int, tuple[weakref.ref, dict]] = {}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()  # a CPU-only torch cannot ask


def packed(qweight: torch.Tensor, key: tuple, make):
    """``make()``'s repack of ``qweight`` for ``key`` (made once, kept while ``qweight`` lives), or None
    during CUDA-graph capture when it does not exist yet (the first eager call makes it)."""
    ent = _PACKS.get(id(qweight))
    if ent is None or ent[0]() is not qweight:
        if _capturing():
            return None
        key_id = id(qweight)
        # (the dict bound now: at interpreter exit the module's globals may be gone before the callback runs)
        ent = (weakref.ref(qweight, lambda _, packs=_PACKS: packs.pop(key_id, None)), {})
        _PACKS[key_id] = ent
    cache = ent[1]
    if key not in cache:
        if _capturing():
            return None
        cache[key] = make()
    return cache[key]
