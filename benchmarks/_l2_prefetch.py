"""Ask the GPU's L2 cache for a tensor's bytes ahead of the kernel that reads them (the probes'
helper; measured in ``probe_l2_hit.py`` and ``probe_l2_prefetch.py``, not used by the engine: it did not
make the decode step faster, see docs/quantization.md, "Cross-kernel L2 prefetch").

At decode batch 1 every linear layer is a weight stream, and none of the weights depends on the step's
data. Between the weight streams run short latency-bound kernels (norms, attention, the split merge) that
leave the HBM mostly idle. A prefetch launched on a side stream during such a kernel moves the *next*
linear's weights into L2, so that linear reads them at L2 latency instead of HBM latency.

``l2_prefetch`` only issues hints (``prefetch.global.L2`` per 128-byte line, or one
``cp.async.bulk.prefetch.L2`` per chunk on sm90+): it writes nothing and changes no result. On the CPU,
under the Triton interpreter and on GPUs before sm80 it does nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from infercore.devices import triton_interpreter
from infercore.ops.pdl import pdl_launch, pdl_release, pdl_wait

# Bytes per program by default: 128 lines of 128 bytes (one line per thread of 4 warps).
CHUNK = 16384


@triton.jit
def _l2_prefetch_kernel(p, nbytes, STRIDE, CHUNK: tl.constexpr, BULK: tl.constexpr, LAST: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """Program i asks L2 for bytes ``[i * STRIDE, i * STRIDE + CHUNK)`` of ``p`` (clipped to ``nbytes``).
    With PDL it lets the next kernel start at once, asks before waiting for the previous kernel (nothing in a
    step writes weights), and waits before it exits (completion stays transitive down the chain)."""
    pdl_release(USE_PDL)
    start = tl.program_id(0).to(tl.int64) * STRIDE
    if BULK:
        lane = tl.arange(0, 32)
        size = (tl.minimum(nbytes - start, CHUNK) // 16 * 16).to(tl.int32)
        lead = ((lane == 0) & (size > 0)).to(tl.int32)
        if LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred q; .reg .b64 pol; setp.ne.b32 q, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@q cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.u32 $0, 0; }",
                "=r,l,r,r", [p + start + lane * 0, lead, size + lane * 0], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred q; setp.ne.b32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
                "=r,l,r,r", [p + start + lane * 0, lead, size + lane * 0], dtype=tl.int32, is_pure=False, pack=1)
    elif LAST:
        offs = start + tl.arange(0, CHUNK // 128) * 128
        ok = (offs < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [p + offs, ok], dtype=tl.int32, is_pure=False, pack=1)
    else:
        offs = start + tl.arange(0, CHUNK // 128) * 128
        ok = (offs < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.ne.b32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [p + offs, ok], dtype=tl.int32, is_pure=False, pack=1)

    pdl_wait(USE_PDL)

@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def l2_prefetch(t: torch.Tensor, *, fraction: float = 1.0, bulk: bool = False, evict_last: bool = True,
                chunk: int = CHUNK, pdl: bool = False) -> None:
    """Issue L2 prefetches for ``t``'s storage on the current stream (a hint; no result changes).

    Args:
        t: a contiguous tensor of any dtype.
        fraction: share of the bytes to ask for, in ``(0, 1]``, spread evenly over the tensor (every
            ``round(1 / fraction)``-th chunk of :data:`CHUNK` bytes), so each reader of a slice gets its share.
        bulk: one ``cp.async.bulk.prefetch.L2`` per chunk (sm90+) instead of one ``prefetch.global.L2`` per line.
        evict_last: the prefetched lines carry the ``evict_last`` L2 priority.
        chunk: bytes per program (a power of two >= 4096; bulk: one-warp programs, one prefetch each).
        pdl: launch with programmatic dependent launch (sm90+), for a prefetch inside a chain of PDL kernels.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("t: expected a contiguous tensor")
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
        raise ValueError(f"fraction: expected a number in (0, 1], got {fraction!r}")
    if not isinstance(chunk, int) or chunk < 4096 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two >= 4096, got {chunk!r}")
    if not t.is_cuda or triton_interpreter() or t.numel() == 0:
        return
    cap = _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
    if cap < (8, 0) or (bulk and cap < (9, 0)):
        return
    nbytes = t.numel() * t.element_size()
    every = max(1, round(1 / fraction))
    chunks = triton.cdiv(nbytes, chunk * every)
    _l2_prefetch_kernel[(chunks,)](t.reshape(-1).view(torch.uint8), nbytes, chunk * every, CHUNK=chunk, BULK=bulk,
                                   LAST=evict_last, num_warps=1 if bulk else max(1, min(8, chunk // 4096)),
                                   **pdl_launch(pdl and cap >= (9, 0)))
