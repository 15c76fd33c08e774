"""Triton kernels of multi-LoRA, each token's adapter slot read on the device: per-token BGMV and grouped SGMV.

Shrink ``s[t] = a[slot_t] @ x[t]``: grid ``(T, R blocks, K splits)``; each program reduces a
``[BLOCK_R, K / splits]`` strip of its token's A against x in fp32. Small batches split K (summed
with fp32 atomics into a zeroed output) so that a decode step of one token still spreads its A over
the GPU instead of one program reading all ``R * K`` weights.

Expand ``y[t, n] += s[t, slice(n)] . b[slot_t, n, :]``: grid ``(T, N blocks)``; each program reads a
``[BLOCK_N, r]`` tile of its token's B (contiguous: ``b[slot]`` is ``[N, r]`` row-major), picks each
column's slice of ``s`` with up to three column bounds passed as scalars, and adds in fp32.

Both are memory-bound GEMVs (each token reads its adapter's A and B; tokens sharing an adapter
re-read it from L2). From ``GROUPED_MIN_TOKENS`` tokens (32; or always with ``grouped=True``, never with None) the
grouped kernels replace them (Punica's SGMV,
as vLLM sorts tokens by adapter): programs take tiles of 16 tokens in slot order (``order``, any
permutation of the tokens; sorted, a tile holds one adapter or a few), loop over the slots the tile holds
with each other token masked out, and multiply on the tensor cores
(``tl.dot``; fp32 operands in full fp32), so an adapter's A and B tiles are read once per tile of
tokens rather than once per token. The grouped shrink splits K over the grid as the BGMV one does.

Nothing here synchronizes or branches on tensor values on the host, so all are
CUDA-graph capturable; a negative slot makes its programs skip all loads (shrink stores zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infercore.devices import capability, register

# Elements of weight tile per program: 4096 fp32 partial sums over 128 threads = 32 registers each.
_TILE = 4096
# Tokens from which the grouped kernels (tiles of tokens in slot order, tensor-core products) replace BGMV by default;
# None: only when asked (grouped=True). H100, 8B shape, four rank-16 adapters on all 7 projections, the pair in a CUDA
# graph (results/h100/lora.json): qkv 10.2 vs 25.5 us (BGMV vs grouped) at 16 tokens, 24.5 vs 18.8 at 64, 48.1 vs
# 18.4 at 256; gate_up 13.0 vs 55.2, 32.3 vs 31.9, 103.6 vs 54.5. Decode vs the base model's rate: from 8 tokens
# 0.722 at batch 16 (0.816 without); from 32, 0.791 / 0.772 / 0.784 / 0.771 at batch 32 / 48 / 64 / 128 against
# 0.788 / 0.743 / 0.700 / 0.657 without (results/h100/sweeps/lora_e2e_grouped_*.json, lora_e2e.json).
GROUPED_MIN_TOKENS: int | None = 32


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, idx_ptr, out_ptr,
    R, K, K_PER_SPLIT,
    stride_xt, stride_as, stride_ar, stride_it, stride_ot,
    ATOMIC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    slot = tl.load(idx_ptr + t * stride_it).to(tl.int64)
    if slot >= 0:
        k_lo = tl.program_id(2) * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        a_rows = a_ptr + slot * stride_as + rows[:, None] * stride_ar
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < k_hi
            xv = tl.load(x_ptr + t * stride_xt + cols, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_rows + cols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += av * xv[None, :]
        part = tl.sum(acc, axis=1)
        if ATOMIC:
            tl.atomic_add(out_ptr + t * stride_ot + rows, part, mask=rmask, sem="relaxed")
        else:
            tl.store(out_ptr + t * stride_ot + rows, part, mask=rmask)
    elif not ATOMIC:  # the atomic path's output starts zeroed
        tl.store(out_ptr + t * stride_ot + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=rmask)


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, idx_ptr,
    N, RANK, BOUND0, BOUND1, BOUND2,
    stride_yt, stride_st, stride_bs, stride_bn, stride_it,
    NSLICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + t * stride_it).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        b_rows = b_ptr + slot * stride_bs + cols[:, None] * stride_bn
        s_row = s_ptr + t * stride_st
        acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, RANK, BLOCK_R):
            ks = k0 + tl.arange(0, BLOCK_R)
            kmask = ks < RANK
            bv = tl.load(b_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            # Each column's slice of s, selected in registers: the (at most 4) slices' r values are
            # loaded once per program instead of gathered per column.
            sv = tl.load(s_row + ks, mask=kmask, other=0.0)[None, :]
            if NSLICES > 1:
                sv = tl.where(cols[:, None] >= BOUND0, tl.load(s_row + RANK + ks, mask=kmask, other=0.0)[None, :], sv)
            if NSLICES > 2:
                s2 = tl.load(s_row + 2 * RANK + ks, mask=kmask, other=0.0)
                sv = tl.where(cols[:, None] >= BOUND1, s2[None, :], sv)
            if NSLICES > 3:
                s3 = tl.load(s_row + 3 * RANK + ks, mask=kmask, other=0.0)
                sv = tl.where(cols[:, None] >= BOUND2, s3[None, :], sv)
            acc += bv * sv
        y_row = y_ptr + t * stride_yt + cols
        yv = tl.load(y_row, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_row, (yv + tl.sum(acc, axis=1)).to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _tile_tokens(idx_ptr, ord_ptr, T, stride_it, BLOCK_M: tl.constexpr):
    """A tile of ``BLOCK_M`` tokens in slot order: their token ids, slots (-1 past T) and the range of
    non-negative slots present ``[lo, hi]`` (empty when lo > hi). Sorted, so every slot of the range that
    a token holds is one contiguous run of the tile."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < T
    tok = tl.load(ord_ptr + m, mask=mmask, other=0).to(tl.int64)
    slot = tl.load(idx_ptr + tok * stride_it, mask=mmask, other=-1).to(tl.int32)
    lo = tl.min(tl.where(slot >= 0, slot, 2147483647), axis=0)
    hi = tl.max(slot, axis=0)
    return tok, slot, lo, hi


@triton.jit
def _next_slot(slot, s):
    """The tile's smallest slot above ``s`` (past ``hi`` when none): the grouped loops visit only the slots the
    tile holds, not every value between its smallest and largest. Slots of the experts' LoRA (``slot * E + expert``)
    are sparse, so a tile of 16 rows can span hundreds of values it does not hold."""
    return tl.min(tl.where(slot > s, slot, 2147483647), axis=0)


@triton.jit
def _shrink_grouped_kernel(
    x_ptr, a_ptr, idx_ptr, ord_ptr, out_ptr,
    T, R, K, K_PER_SPLIT,
    stride_xt, stride_as, stride_ar, stride_it, stride_ot,
    ATOMIC: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tok, slot, lo, hi = _tile_tokens(idx_ptr, ord_ptr, T, stride_it, BLOCK_M)
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    k_lo = tl.program_id(1) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    s = lo
    while s <= hi:  # the tile's adapters (usually one): each A tile read once for all its tokens
        sel = slot == s
        a_rows = a_ptr + tl.cast(s, tl.int64) * stride_as + rows[:, None] * stride_ar
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < k_hi
            xv = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :], mask=sel[:, None] & kmask[None, :],
                         other=0.0)
            av = tl.load(a_rows + cols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv, tl.trans(av), input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(av))
        s = _next_slot(slot, s)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = out_ptr + tok[:, None] * stride_ot + rows[None, :]
    omask = (m < T)[:, None] & rmask[None, :]
    if ATOMIC:  # the output starts zeroed; tokens without an adapter add nothing
        tl.atomic_add(o, acc, mask=omask & (slot >= 0)[:, None], sem="relaxed")
    else:  # zeros for tokens without an adapter
        tl.store(o, acc, mask=omask)


@triton.jit
def _expand_grouped_kernel(
    y_ptr, s_ptr, b_ptr, idx_ptr, ord_ptr,
    T, N, RANK, BOUND0, BOUND1, BOUND2,
    stride_yt, stride_st, stride_bs, stride_bn, stride_it,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    tok, slot, lo, hi = _tile_tokens(idx_ptr, ord_ptr, T, stride_it, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    nmask = cols < N
    # the slices this column tile touches: j_lo .. j_hi (one unless the tile straddles a bound)
    n1 = tl.minimum(n0 + BLOCK_N, N) - 1
    j_lo = (n0 >= BOUND0).to(tl.int32) + (n0 >= BOUND1).to(tl.int32) + (n0 >= BOUND2).to(tl.int32)
    j_hi = (n1 >= BOUND0).to(tl.int32) + (n1 >= BOUND1).to(tl.int32) + (n1 >= BOUND2).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s = lo
    while s <= hi:
        sel = slot == s
        b_rows = b_ptr + tl.cast(s, tl.int64) * stride_bs + cols[:, None] * stride_bn
        for j in range(j_lo, j_hi + 1):
            c_lo = tl.where(j == 0, 0, tl.where(j == 1, BOUND0, tl.where(j == 2, BOUND1, BOUND2)))
            c_hi = tl.where(j == 0, BOUND0, tl.where(j == 1, BOUND1, tl.where(j == 2, BOUND2, N)))
            cmask = nmask & (cols >= c_lo) & (cols < c_hi)
            for k0 in range(0, RANK, BLOCK_R):
                ks = k0 + tl.arange(0, BLOCK_R)
                kmask = ks < RANK
                sv = tl.load(s_ptr + tok[:, None] * stride_st + j * RANK + ks[None, :],
                             mask=sel[:, None] & kmask[None, :], other=0.0)
                bv = tl.load(b_rows + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                acc += tl.dot(sv, tl.trans(bv), input_precision="ieee")
        s = _next_slot(slot, s)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ymask = ((m < T) & (slot >= 0))[:, None] & nmask[None, :]
    yp = y_ptr + tok[:, None] * stride_yt + cols[None, :]
    yv = tl.load(yp, mask=ymask, other=0.0).to(tl.float32)
    tl.store(yp, (yv + acc).to(y_ptr.dtype.element_ty), mask=ymask)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _target_programs(device: torch.device) -> int:
    # Enough programs to keep every multiprocessor's memory pipe busy (a few per SM).
    return 4 * capability(device).multiprocessors


def _shrink_config(T: int, R: int, K: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, splits of K) from the shapes only (so a captured graph's batch size fixes them)."""
    block_r = min(triton.next_power_of_2(R), 16)
    block_k = min(max(_TILE // block_r, 16), triton.next_power_of_2(max(K, 1)))
    k_blocks = triton.cdiv(K, block_k)
    base = T * triton.cdiv(R, block_r)
    split = min(k_blocks, max(1, _target_programs(device) // max(base, 1)))
    return block_r, block_k, split


def _split_output(T: int, R: int, K: int, bk: int, split: int, device: torch.device
                  ) -> tuple[int, int, torch.Tensor]:
    """``(K per split, splits, fp32 [T, R] output)`` of a shrink over ``split`` parts of K in ``bk`` blocks: every
    split but the last covers whole blocks, recounted so none is empty; the output zeroed where several splits add
    into it with atomics."""
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = max(triton.cdiv(K, k_per_split), 1)
    out = (torch.zeros if split > 1 else torch.empty)((T, R), dtype=torch.float32, device=device)
    return k_per_split, split, out


def _use_grouped(T: int, grouped: bool | None) -> bool:
    if grouped is not None:
        return grouped
    return GROUPED_MIN_TOKENS is not None and T >= GROUPED_MIN_TOKENS


def _order(indices: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return torch.argsort(indices, stable=True) if order is None else order


def _grouped_shrink_config(T: int, R: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_R, BLOCK_K, splits of K) of the grouped shrink, from the shapes only."""
    block_m = 16
    block_r = max(16, triton.next_power_of_2(R))
    block_k = min(max(_TILE // block_r, 16), 128, max(16, triton.next_power_of_2(K)))
    tiles = triton.cdiv(T, block_m)
    split = min(triton.cdiv(K, block_k), max(1, _target_programs(device) // tiles))
    return block_m, block_r, block_k, split


def _grouped_shrink(x, a, indices, order, block_k=None, split_k=None) -> torch.Tensor:
    T, K = x.shape
    R = a.shape[1]
    bm, br, bk, split = _grouped_shrink_config(T, R, K, x.device)
    bk = block_k or bk
    k_per_split, split, out = _split_output(T, R, K, bk, split_k or split, x.device)
    atomic = split > 1
    if T == 0:
        return out
    x, a = _inner_contiguous(x), _inner_contiguous(a)
    _shrink_grouped_kernel[(triton.cdiv(T, bm), split)](
        x, a, indices, order, out, T, R, K, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), indices.stride(0), out.stride(0),
        ATOMIC=atomic, IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return out


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    indices: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
    grouped: bool | None = None,
    block_r: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``out[t] = a[indices[t]] @ x[t]`` fp32 ``[T, R]`` for x ``[T, K]``, a ``[S, R, K]``, indices ``[T]``.

    With ``grouped=True`` (or from ``GROUPED_MIN_TOKENS`` tokens, when that is set) the grouped kernel runs: tiles
    of tokens in slot order (``order``, the stable argsort of ``indices``; computed here when not given), each
    adapter's A read once per tile as a tensor-core product, instead of once per token. ``block_r`` / ``block_k``
    (powers of two) and ``split_k`` override the shape heuristic (tests, sweeps; the grouped kernel takes the last
    two).
    """
    T, K = x.shape
    R = a.shape[1]
    if _use_grouped(T, grouped):
        return _grouped_shrink(x, a, indices, _order(indices, order), block_k, split_k)
    br, bk, split = _shrink_config(T, R, K, x.device)
    br, bk = block_r or br, block_k or bk
    k_per_split, split, out = _split_output(T, R, K, bk, split_k or split, x.device)
    atomic = split > 1
    if T == 0:
        return out
    x, a = _inner_contiguous(x), _inner_contiguous(a)
    _shrink_kernel[(T, triton.cdiv(R, br), split)](
        x, a, indices, out, R, K, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), indices.stride(0), out.stride(0),
        ATOMIC=atomic, BLOCK_R=br, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return out


def _expand_config(T: int, N: int, r: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_R): a ``_TILE``-element B tile, narrower while the grid is short of programs."""
    block_r = min(triton.next_power_of_2(r), 64)
    block_n = min(max(_TILE // block_r, 16), triton.next_power_of_2(max(N, 1)))
    target = _target_programs(device)
    while block_n > 32 and T * triton.cdiv(N, block_n) < target:
        block_n //= 2
    return block_n, block_r


def _grouped_expand_config(T: int, N: int, r: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R) of the grouped expand."""
    block_m = 16
    block_r = min(max(16, triton.next_power_of_2(r)), 64)
    block_n = 128
    while block_n > 32 and triton.cdiv(T, block_m) * triton.cdiv(N, block_n) < _target_programs(device):
        block_n //= 2
    return block_m, block_n, block_r


def lora_expand_(
    y: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    *,
    slice_bounds: tuple[int, ...] = (),
    order: torch.Tensor | None = None,
    grouped: bool | None = None,
    block_n: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """``y[t, n] += s[t, j*r:(j+1)*r] . b[indices[t], n]`` in place (``j``: slice of column ``n``); returns y.

    ``order`` / ``grouped`` as in :func:`lora_shrink`. ``block_n`` / ``block_r`` (powers of two) override the
    shape heuristic (tests, sweeps).
    """
    if len(slice_bounds) > 3:
        raise ValueError(f"lora_expand_: the Triton kernel takes at most 3 slice_bounds, got {slice_bounds}")
    T, N = y.shape
    r = b.shape[2]
    if _use_grouped(T, grouped):
        if T == 0 or N == 0:
            return y
        bm, bn, br = _grouped_expand_config(T, N, r, y.device)
        bn, br = block_n or bn, max(16, block_r or br)
        s, b = _inner_contiguous(s), _inner_contiguous(b)
        bounds = (*slice_bounds, N, N, N)[:3]
        _expand_grouped_kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn))](
            y, s, b, indices, _order(indices, order), T, N, r, *bounds,
            y.stride(0), s.stride(0), b.stride(0), b.stride(1), indices.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, num_warps=4,
        )  # fmt: skip
        return y
    bn, br = _expand_config(T, N, r, y.device)
    bn, br = block_n or bn, block_r or br
    if T == 0 or N == 0:
        return y
    s, b = _inner_contiguous(s), _inner_contiguous(b)
    bounds = (*slice_bounds, N, N, N)[:3]  # unused bounds: never reached
    _expand_kernel[(T, triton.cdiv(N, bn))](
        y, s, b, indices, N, r, *bounds,
        y.stride(0), s.stride(0), b.stride(0), b.stride(1), indices.stride(0),
        NSLICES=len(slice_bounds) + 1, BLOCK_N=bn, BLOCK_R=br, num_warps=4,
    )  # fmt: skip
    return y


_available = lambda cap: cap.is_cuda and cap.triton
register("lora_shrink", "triton", lora_shrink, priority=10, available=_available)
register("lora_expand_", "triton", lora_expand_, priority=10, available=_available)
