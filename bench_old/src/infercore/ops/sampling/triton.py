"""Triton sampler: temperature, top-k, top-p, min-p and the exponential race, without a sort.

One program samples one row of ``logits [B, V]``, streaming the row in ``BLOCK`` chunks:

1. max / argmax of the (penalized) logits; greedy rows (``temperature == 0``) stop here. With few
   rows this pass runs first over ``PARTS`` slices of each row in parallel (``_argmax_parts_kernel``),
   and the sampling program reduces the slices' results: one program streaming a 128K-token row
   alone is ~25 us of a batch-1 decode step (results/h200/sweeps/probe_bs1_fp8_nopdl.json); sliced,
   2.7 us (results/h200/sampling.json).
2. top-k threshold: bisection over the values of ``z = x / T`` for the largest pivot with at least
   ``k`` values above it. It stops as soon as exactly ``k`` values lie above the pivot, or no value
   lies strictly inside the bracket, or no float does (so it is exact: the pivot lands on the k-th
   largest value, and ties at the boundary are kept, as in the reference).
3. top-p threshold: the same bisection on the probability mass above the pivot (among the top-k
   survivors), i.e. the largest pivot whose upper set holds ``>= top_p`` of the mass.
4. min-p needs no search: ``p_i >= min_p * p_max``  <=>  ``exp(z_i - z_max) >= min_p``.
5. exponential race ``argmax(z_i - log E_i)`` over the survivors, ``E_i = -log U_i`` with ``U_i`` from
   Philox keyed by the row's seed and countered by ``(token id, offset)``: a function of
   ``(seed, offset)`` alone, and seeds/offsets are device tensors, so the step is graph-capturable.

Each search pass re-reads the row (from L2 for realistic vocabularies); a search takes about
``log2(value range / gap at the threshold)`` passes (10-20 for real vocabularies), and only runs
when top-k/top-p are on. The random stream differs from the reference's CPU generator; the
filtered support and the sampling distribution are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import capability, register, triton_interpreter
from infercore.ops.pdl import pdl_enabled, pdl_launch, pdl_release, pdl_wait

from .naive import apply_repetition_penalty

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _upper_set(x_ptr, V, t, z_max, pivot, BLOCK: tl.constexpr):
    """Count and unnormalized probability mass (``exp(z - z_max)``) of the tokens with ``z >= pivot``.

    ``z = x / T`` uses correctly rounded division, so it matches the reference's ``x / T`` bit for
    bit. (Written inline rather than through helpers: the interpreter pays per helper call.)
    """
    mass = tl.zeros([], dtype=tl.float32)
    cnt = tl.zeros([], dtype=tl.int32)
    for c in range(0, V, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        z = tl.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), t)
        sel = (z >= pivot) & (offs < V)
        mass += tl.sum(tl.where(sel, tl.exp2((z - z_max) * _LOG2E), 0.0), axis=0)
        cnt += tl.sum(sel.to(tl.int32), axis=0)
    return mass, cnt


@triton.jit
def _argmax_scan(x_ptr, start, end, BLOCK: tl.constexpr):
    """Max, first-occurrence argmax and smallest finite value of ``x[start:end]`` (``best`` -inf and
    ``best_i`` 0 when no value beats -inf; NaNs are never picked)."""
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([], dtype=tl.int32)
    low = tl.full([], float("inf"), dtype=tl.float32)  # smallest finite logit: a bracket for the searches
    for c in range(start, end, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        low = tl.minimum(low, tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=0))
        cm, ci = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        upd = cm > best  # strict: an earlier chunk wins ties, like torch.argmax
        best_i = tl.where(upd, ci + c, best_i)
        best = tl.where(upd, cm, best)
    return best, best_i, low


@triton.jit(do_not_specialize=["parts"])
def _argmax_parts_kernel(x_ptr, stride_x, V, chunk, best_ptr, idx_ptr, low_ptr, parts, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """Pass 1 over slice ``p`` (``chunk`` tokens) of row ``r``: results to ``[B, parts]`` buffers."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * chunk
    best, best_i, low = _argmax_scan(x_ptr + row.to(tl.int64) * stride_x, start, tl.minimum(start + chunk, V),
                                     BLOCK)
    o = row * parts + part
    tl.store(best_ptr + o, best)
    tl.store(idx_ptr + o, best_i)
    tl.store(low_ptr + o, low)


@triton.jit(do_not_specialize=["parts"])
def _sample_kernel(
    x_ptr, stride_x, V,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, offset_ptr, out_ptr,
    best_ptr, idx_ptr, low_ptr, parts,  # parts > 0: pass 1 ran in _argmax_parts_kernel over this many slices
    BLOCK: tl.constexpr,
    PARTS_BLOCK: tl.constexpr = 0,  # 0: no first pass (parts 0); else a power of two >= parts, the reduce's width
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    x_ptr += row.to(tl.int64) * stride_x

    # Pass 1: max and first-occurrence argmax of the raw (penalized) logits.
    if PARTS_BLOCK > 0:
        # The slices in order, as the sequential scan would meet them: the first slice holding the
        # maximum gives the index (a slice's maximum is never NaN: _argmax_scan skips NaNs).
        offs_p = tl.arange(0, PARTS_BLOCK)
        pmask = offs_p < parts
        pm = tl.load(best_ptr + row * parts + offs_p, mask=pmask, other=float("-inf"))
        best, win = tl.max(pm, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_i = tl.where(best > float("-inf"), tl.load(idx_ptr + row * parts + win), 0)
        low = tl.min(tl.load(low_ptr + row * parts + offs_p, mask=pmask, other=float("inf")), axis=0)
    else:
        best, best_i, low = _argmax_scan(x_ptr, 0, V, BLOCK)
    t = tl.load(temp_ptr + row)
    if t == 0.0:
        tl.store(out_ptr + row, best_i.to(tl.int64))
    else:
        z_max = tl.div_rn(best, t)
        # Bracket [lo, hi): the predicate holds at lo and fails at hi. cnt_* count the values >= each
        # end; a search stops once at most one value lies in [lo, hi) or no float lies strictly
        # inside it (then every pivot in the bracket selects the same set). NaN brackets (all -inf
        # rows) fail every comparison and skip the searches.
        lo = tl.div_rn(low, t)
        hi_init = z_max + tl.maximum(tl.abs(z_max), 1.0)  # above every value
        cnt_lo = V

        # top-k: the largest pivot with count(z >= pivot) >= k is the k-th largest value.
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < V):
            hi = hi_init
            cnt_hi = 0
            mid = lo * 0.5 + hi * 0.5
            go = (mid > lo) & (mid < hi)
            while go:
                _, cnt = _upper_set(x_ptr, V, t, z_max, mid, BLOCK)
                if cnt >= k:
                    lo = mid
                    cnt_lo = cnt
                else:
                    hi = mid
                    cnt_hi = cnt
                mid = lo * 0.5 + hi * 0.5
                go = (cnt_lo > k) & (cnt_lo - cnt_hi > 1) & (mid > lo) & (mid < hi)

        # top-p over the top-k survivors: the largest pivot whose upper set holds >= top_p of their mass.
        p = tl.load(top_p_ptr + row)
        if p < 1.0:
            total, _ = _upper_set(x_ptr, V, t, z_max, lo, BLOCK)
            target = p * total
            hi = hi_init
            cnt_hi = 0
            mid = lo * 0.5 + hi * 0.5
            go = (cnt_lo - cnt_hi > 1) & (mid > lo) & (mid < hi)
            while go:
                mass, cnt = _upper_set(x_ptr, V, t, z_max, mid, BLOCK)
                if mass >= target:
                    lo = mid
                    cnt_lo = cnt
                else:
                    hi = mid
                    cnt_hi = cnt
                mid = lo * 0.5 + hi * 0.5
                go = (cnt_lo - cnt_hi > 1) & (mid > lo) & (mid < hi)

        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
        off = tl.load(offset_ptr + row)
        c1 = tl.zeros([BLOCK], dtype=tl.uint32) + (off & 0xFFFFFFFF).to(tl.uint32)
        c2 = tl.zeros([BLOCK], dtype=tl.uint32) + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c3 = tl.zeros([BLOCK], dtype=tl.uint32)
        race = tl.full([], float("-inf"), dtype=tl.float32)
        race_i = best_i
        for c in range(0, V, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            z = tl.div_rn(tl.load(x_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), t)
            e = tl.exp2((z - z_max) * _LOG2E)
            keep = (offs < V) & (z >= lo) & (e >= min_p)
            r, _, _, _ = tl.philox(seed, offs.to(tl.uint32), c1, c2, c3)
            u = tl.maximum(tl.uint_to_uniform_float(r), 1e-30)
            # argmax p_i / E_i == argmax z_i - log(E_i), E_i = -log(U_i) ~ Exp(1).
            score = tl.where(keep, z - tl.log(-tl.log(u)), float("-inf"))
            cm, ci = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            upd = cm > race
            race_i = tl.where(upd, ci + c, race_i)
            race = tl.where(upd, cm, race)
        tl.store(out_ptr + row, race_i.to(tl.int64))


def sample(logits: torch.Tensor, params, *, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``logits [B, V]`` (any float dtype); returns int64 ``[B]``.

    ``params`` is a :class:`~infercore.ops.sampling.SamplingTensors` on the logits' device;
    ``prev_tokens`` int32/int64 ``[B, L]`` padded with ``-1`` enables the repetition penalty.
    No host synchronization: safe inside CUDA-graph capture.
    """
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    x = logits
    if prev_tokens is not None:
        x = apply_repetition_penalty(logits.float(), prev_tokens, params.repetition_penalty)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cap = 1024 if triton_interpreter() else 4096
    BLOCK = min(triton.next_power_of_2(V), cap)
    extra = {} if triton_interpreter() else {"num_warps": 8}
    pdl = pdl_launch(pdl_enabled(x))
    parts = _parts(B, V, BLOCK, x.device)
    if parts:
        chunk = triton.cdiv(triton.cdiv(V, parts), BLOCK) * BLOCK
        best = torch.empty((B, parts), dtype=torch.float32, device=x.device)
        idx = torch.empty((B, parts), dtype=torch.int32, device=x.device)
        low = torch.empty((B, parts), dtype=torch.float32, device=x.device)
        _argmax_parts_kernel[(B, parts)](x, x.stride(0), V, chunk, best, idx, low, parts, BLOCK=BLOCK,
                                         **extra, **pdl)  # fmt: skip
    else:
        best = idx = low = out  # unused
    # The slice count is a runtime argument (not specialized) and the reduce's width a constant, so
    # batches of any size share two compiled variants. As a constexpr, each new count met in eager
    # steps compiled both kernels again mid-run (results/h200/sweeps/hybrid_qwen_compiles.json).
    _sample_kernel[(B,)](
        x, x.stride(0), V,
        params.temperature, params.top_k, params.top_p, params.min_p, params.seeds, params.offsets, out,
        best, idx, low, parts, BLOCK=BLOCK, PARTS_BLOCK=_PARTS_MAX if parts else 0, **extra, **pdl,
    )  # fmt: skip
    return out


_PARTS_MAX = 64


def _parts(batch: int, vocab: int, block: int, device: torch.device) -> int:
    """Slices per row for the parallel first pass (0: the sampling program scans the row itself).
    Only while the rows alone leave most multiprocessors idle; a power of two (the reduce's width),
    each slice at least one ``block``. From static shapes only, so graph capture sees a fixed launch."""
    sms = capability(device).multiprocessors if device.type == "cuda" else 4
    if batch * 2 > sms:
        return 0
    parts = min(triton.next_power_of_2(triton.cdiv(2 * sms, batch)), _PARTS_MAX)
    while parts > 1 and parts > triton.cdiv(vocab, block):
        parts //= 2
    return parts if parts > 1 else 0


register("sample", "triton", sample, priority=10, available=lambda cap: cap.is_cuda and cap.triton)
