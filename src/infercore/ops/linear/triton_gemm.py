"""Persistent stream-K Triton GEMM for batched decode: ``y = x @ W^T (+ bias)``, M = 64..512 rows.

At batch 64-512 a Llama-8B linear is a few hundred output tiles. cuBLAS runs them as data-parallel
waves over the SMs, so 224 tiles on 132 SMs take two full tile times (1.7 waves, 15% idle) and the
split-K it picks for the long-K down projection adds a reduce kernel. This kernel gives every SM the
same number of MMA K-steps instead.

Schedule (host, :func:`_schedule`): ``T`` output tiles of ``k_iters`` K-steps each, ``P`` programs
(one per SM). If ``T`` is a multiple of ``P`` (or stream-K is off) every tile is data-parallel: program
``p`` owns tiles ``p, p + P, ...``. Otherwise the first ``(T // P - 1) * P`` tiles are data-parallel
waves and the rest (one wave plus the remainder) are *stream-K*: their ``sk_tiles * k_iters`` K-steps,
laid end to end tile after tile, are cut into ``P`` contiguous ranges that differ by at most one step.
A range covers whole tiles in its middle and parts of one tile at each end.

Kernel: each program walks its K-steps (data-parallel ones first) in one flat loop, so the software
pipeliner keeps loading across tile boundaries; a tile's epilogue runs inside the loop when its last
step of the range is done. A whole tile goes straight to the output (bias, activation, cast). A part
of a tile stores its fp32 accumulator in a workspace slot (two per program: the part at the start of
its range and the part at the end), then bumps the tile's arrival counter; the contributor that
arrives last sums every contributor's slot in row chunks (so no second full accumulator is live),
runs the epilogue and resets the counter to zero, so the next launch and CUDA-graph replays start
clean. Nobody waits for anybody, so programs may run in any order (the interpreter runs them one by
one). Operands come through host TMA descriptors when strides allow, else pointer loads.

Gated epilogue (``act``): for a merged ``[gate; up]`` weight ``[2D, K]`` a tile of ``BLOCK_N // 2``
output columns loads the gate rows ``c`` and the up rows ``D + c`` as two B tiles into two
accumulators (two MMAs of the same A tile) and writes ``act(g) * u`` ``[M, D]``. g and u are rounded
to the output dtype first, as the unfused ``F.linear`` + ``silu_and_mul`` path stores them.

Layouts: ``x [M, K]`` (K contiguous), ``w [N, K]`` row-major (nn.Linear), ``bias [N]``, ``y [M, N]``
(``[M, N // 2]`` with act) in x.dtype; fp32 accumulation. Arrival counters are one buffer per device:
launches on one stream are ordered, but two launches must not run concurrently on different streams.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from infercore.devices import triton_interpreter

from .. import _validate as V
from .naive import skinny_linear_ref
from .triton import ACTIVATIONS, _act_mul

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["DEFAULT", "GemmConfig", "TUNED", "gemm_bf16", "m_bucket", "pick_config"]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration.

    ``block_n`` counts weight rows per tile; with ``act`` that is gate + up rows, so the tile writes
    ``block_n // 2`` output columns (each of the two MMAs is ``block_m x block_n / 2``).
    ``programs``: persistent grid size, 0 = one per SM (tests set a few to force stream-K splits).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    stream_k: bool = True
    tma: bool = True
    programs: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Tuned on the H200 by benchmarks/sweep_gemm_bf16.py (its printed lines paste here). Key:
# (N, K, M-bucket) with N the weight's rows (the merged 2D for the gated epilogue) and M-bucket in
# 64, 128, 256, 512; value: (config, speedup over cuBLAS F.linear [+ silu_and_mul]).
TUNED: dict[tuple[int, int, int], tuple[GemmConfig, float]] = {}
# Same key for the gated epilogue (act=...); untuned shapes fall back to TUNED, then DEFAULT.
TUNED_ACT: dict[tuple[int, int, int], tuple[GemmConfig, float]] = {}

# One M tile covers the batch where it can: with two row tiles in flight at different K offsets
# (stream-K ranges) each weight byte would stream from HBM twice.
DEFAULT = GemmConfig(128, 256, 64, num_warps=8, num_stages=3)
DEFAULT_SMALL_M = GemmConfig(64, 128, 64, num_warps=4, num_stages=4)
DEFAULT_LARGE_M = GemmConfig(256, 128, 64, num_warps=8, num_stages=3)
# The interpreter runs ~1 ms per program and op: tiny tiles, a few programs.
_INTERP_CONFIG = GemmConfig(16, 32, 16, num_warps=1, num_stages=1, group_m=2, tma=False, programs=3)

M_BUCKETS = (64, 128, 256, 512)


def m_bucket(m: int) -> int:
    """Smallest of 64, 128, 256, 512 that holds ``m`` rows (512 for more)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def pick_config(n: int, k: int, m: int, act: str | None = None) -> GemmConfig:
    """Launch config for weight ``[n, k]`` and ``m`` rows: the tuned entry (``TUNED_ACT`` first with
    ``act``), else a default by M (one row tile up to 256 rows)."""
    if triton_interpreter():
        return _INTERP_CONFIG
    b = m_bucket(m)
    hit = (TUNED_ACT.get((n, k, b)) if act is not None else None) or TUNED.get((n, k, b))
    if hit is not None:
        return hit[0]
    if m <= 64:
        return DEFAULT_SMALL_M
    return DEFAULT if m <= 128 else DEFAULT_LARGE_M


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles sweep the columns together so their B tiles stay in L2.
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def _range_start(p, base, rem):
    """First stream-K step of program ``p``: ranges of ``base + 1`` steps for ``p < rem``, then ``base``."""
    return p * base + tl.minimum(p, rem)


@triton.jit
def _owner(i, base, rem):
    """The program whose stream-K range holds step ``i`` (``base >= 1``)."""
    big = rem * (base + 1)
    return tl.where(i < big, i // (base + 1), rem + (i - big) // base)


@triton.jit
def _epilogue(g, u, offs_m, offs_n, bias_ptr, y_ptr, M, NOUT, stride_ym,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Bias, activation, cast and masked store of fp32 ``g [R, C]`` (and ``u``, the up half, with ACT)
    to ``y[offs_m, offs_n]``."""
    n_mask = offs_n < NOUT
    if HAS_BIAS:
        g += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            u += tl.load(bias_ptr + NOUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:
        out = _act_mul(g, u, y_ptr, ACT)
    else:
        out = g
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


# M, the grid and the schedule scalars vary with the batch; not specializing them (on value 1 or
# divisibility by 16) keeps one compiled kernel per config and shape class.
@triton.jit(do_not_specialize=["M", "num_progs", "dp_tiles", "sk_base", "sk_rem", "k_iters"])
def _gemm_kernel(
    a_ptr, b_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, NOUT, K, stride_am, stride_bn, stride_ym,
    num_progs, dp_tiles, sk_base, sk_rem, k_iters,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, MAX_CONTRIB: tl.constexpr, RED_M: tl.constexpr, NUM_THREADS: tl.constexpr,
):  # fmt: skip
    """``BLOCK_N`` is output columns per tile (the per-MMA N). With ACT the weight is ``[2 * NOUT, K]``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(NOUT, BLOCK_N)
    # Data-parallel tiles pid, pid + P, ... below dp_tiles, then the stream-K range [sk_lo, sk_hi).
    n_dp = tl.cdiv(tl.maximum(dp_tiles - pid, 0), num_progs)
    dp_len = n_dp * k_iters
    sk_lo = _range_start(pid, sk_base, sk_rem)
    sk_hi = _range_start(pid + 1, sk_base, sk_rem)
    n_iter = dp_len + sk_hi - sk_lo
    SLOT: tl.constexpr = BLOCK_M * BLOCK_N * (2 if ACT != 0 else 1)  # fp32 elements per workspace slot
    loc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over the program's K-steps (no nested loop: the pipeliner skips outer loops).
    for j in range(0, n_iter):
        g_sk = sk_lo + (j - dp_len)
        in_dp = j < dp_len
        tile = tl.where(in_dp, pid + (j // k_iters) * num_progs, dp_tiles + g_sk // k_iters)
        kk = tl.where(in_dp, j % k_iters, g_sk % k_iters)
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        k0 = kk * BLOCK_K
        if USE_TMA:  # out-of-bounds boxes are zero-filled by the TMA unit
            a = a_ptr.load([off_m, k0])
            b = b_ptr.load([off_n, k0])
            if ACT != 0:
                b_u = b_ptr.load([NOUT + off_n, k0])
        else:
            # Wrapped row indices: duplicate rows are never stored and keep the loads unmasked in M/N.
            offs_k = k0 + tl.arange(0, BLOCK_K)
            rows_a = ((off_m + tl.arange(0, BLOCK_M)) % M).to(tl.int64) * stride_am
            rows_b = ((off_n + tl.arange(0, BLOCK_N)) % NOUT).to(tl.int64) * stride_bn
            a_ptrs = a_ptr + rows_a[:, None] + offs_k[None, :]
            b_ptrs = b_ptr + rows_b[:, None] + offs_k[None, :]
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                if ACT != 0:
                    b_u = tl.load(b_ptrs + NOUT * stride_bn)
            else:
                k_ok = offs_k[None, :] < K
                a = tl.load(a_ptrs, mask=k_ok, other=0.0)
                b = tl.load(b_ptrs, mask=k_ok, other=0.0)
                if ACT != 0:
                    b_u = tl.load(b_ptrs + NOUT * stride_bn, mask=k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if ACT != 0:
            acc_u = tl.dot(a, tl.trans(b_u), acc_u, input_precision=DOT_PRECISION)
        if (kk == k_iters - 1) | (j == n_iter - 1):
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            t_sk = tile - dp_tiles
            tile_lo = t_sk * k_iters  # first stream-K step of the tile
            # A stream-K part: the range began inside the tile or ends before the tile does.
            part = (tile >= dp_tiles) & ((sk_lo > tile_lo) | (kk != k_iters - 1))
            if part:
                # Slot 0: the part at the start of this program's range; slot 1: the one at its end.
                slot = 2 * pid + (sk_lo < tile_lo).to(tl.int32)
                ws_tile = ws_ptr + slot.to(tl.int64) * SLOT
                if ACT != 0:
                    tl.store(ws_tile + loc, acc)
                    tl.store(ws_tile + BLOCK_M * BLOCK_N + loc, acc_u)
                else:
                    # Even and odd columns apart: the MMA layout holds column pairs, so the split is
                    # free, and each half's trip through shared memory for the store is half as big
                    # (the whole fp32 tile's would not fit beside the pipeline's buffers).
                    ev, od = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
                    loc2 = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)[None, :]
                    tl.store(ws_tile + loc2, ev)
                    tl.store(ws_tile + loc2 + 1, od)
                p_first = _owner(tile_lo, sk_base, sk_rem)
                p_last = _owner(tile_lo + k_iters - 1, sk_base, sk_rem)
                # Every thread releases its own stores with its own arrival (a CTA barrier here would
                # stop the pipeliner); the thread that sees the tile's final count acquires them all,
                # and the max tells its whole program.
                one = tl.full((NUM_THREADS,), 1, tl.int32)
                arrived = tl.max(tl.atomic_add(cnt_ptr + t_sk + one * 0, one, sem="acq_rel", scope="gpu"), axis=0)
                if arrived == NUM_THREADS * (p_last - p_first + 1) - 1:
                    # Last contributor: sum every contributor's slot (its own included) in row chunks.
                    for r in tl.static_range(0, BLOCK_M, RED_M):
                        c_loc = (r + tl.arange(0, RED_M))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                        tot = tl.zeros((RED_M, BLOCK_N), dtype=tl.float32)
                        tot_u = tl.zeros((RED_M, BLOCK_N), dtype=tl.float32)
                        for i in tl.static_range(MAX_CONTRIB):
                            q = p_first + i
                            q_slot = 2 * q + (_range_start(q, sk_base, sk_rem) < tile_lo).to(tl.int32)
                            q_tile = ws_ptr + q_slot.to(tl.int64) * SLOT
                            ok = (c_loc * 0 + q) <= p_last  # a tensor mask: the interpreter rejects a scalar one
                            tot += tl.load(q_tile + c_loc, mask=ok, other=0.0, cache_modifier=".cg")
                            if ACT != 0:
                                tot_u += tl.load(q_tile + BLOCK_M * BLOCK_N + c_loc, mask=ok, other=0.0,
                                                 cache_modifier=".cg")
                        _epilogue(tot, tot_u, off_m + r + tl.arange(0, RED_M), offs_n, bias_ptr, y_ptr, M, NOUT,
                                  stride_ym, ACT, HAS_BIAS)
                    tl.atomic_xchg(cnt_ptr + t_sk, 0)  # ready for the next launch (graph replays too)
            else:
                _epilogue(acc, acc_u, offs_m, offs_n, bias_ptr, y_ptr, M, NOUT, stride_ym, ACT, HAS_BIAS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if ACT != 0:
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Host-side split of ``tiles x k_iters`` K-steps over ``programs`` (see the module docstring)."""

    programs: int
    dp_tiles: int  # tiles [0, dp_tiles) are data-parallel
    sk_tiles: int  # tiles [dp_tiles, dp_tiles + sk_tiles) are stream-K
    sk_base: int  # each program's stream-K range has sk_base (+1 for the first sk_rem) steps
    sk_rem: int
    max_contrib: int  # bound on the programs sharing one stream-K tile (a power of two)


@functools.lru_cache(maxsize=1024)
def _schedule(tiles: int, k_iters: int, programs: int, stream_k: bool) -> Schedule:
    if not stream_k or k_iters == 1 or tiles % programs == 0:
        return Schedule(min(programs, tiles), tiles, 0, 0, 0, 1)
    # One full wave joins the remainder: each stream-K tile is then shared by about two programs
    # instead of the remainder alone being cut into P slivers.
    dp = max(tiles // programs - 1, 0) * programs
    sk_tiles = tiles - dp
    total = sk_tiles * k_iters
    progs = min(programs, total)
    base, rem = divmod(total, progs)
    # k_iters consecutive steps meet at most 1 + ceil((k_iters - 1) / base) ranges of >= base steps.
    contrib = min(progs, 1 + triton.cdiv(k_iters - 1, base))
    return Schedule(progs, dp, sk_tiles, base, rem, triton.next_power_of_2(contrib))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (the kernel resets each one it uses). One buffer per device,
    made outside CUDA-graph capture; a capture that needs a larger one gets its own (its zero fill
    is captured too, so replays stay correct)."""
    c = _COUNTERS.get(device)
    if c is not None and c.numel() >= n:
        return c
    c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _COUNTERS[device] = c
    return c


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Every tensor 2-D with unit inner stride, 16-byte aligned base and row stride (TMA's rules)."""
    return TensorDescriptor is not None and all(
        t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in ts
    )


def _check_config(cfg: object, act: str | None) -> GemmConfig:
    op = "gemm_bf16"
    if not isinstance(cfg, GemmConfig):
        raise TypeError(f"{op}: config must be a GemmConfig or None, got {type(cfg).__name__}")
    pow2 = lambda v: isinstance(v, int) and v >= 16 and v & (v - 1) == 0
    n_per_dot = cfg.block_n // 2 if act is not None else cfg.block_n
    if not (pow2(cfg.block_m) and pow2(cfg.block_k) and pow2(n_per_dot)):
        raise ValueError(
            f"{op}: config block_m, block_k and block_n{' // 2 (act)' if act else ''} must be powers of two >= 16, "
            f"got {cfg.block_m}, {cfg.block_k}, {cfg.block_n}"
        )
    if cfg.num_warps < 1 or cfg.num_stages < 1 or cfg.group_m < 1 or cfg.programs < 0:
        raise ValueError(f"{op}: config num_warps, num_stages, group_m must be >= 1 and programs >= 0, got {cfg}")
    return cfg


def gemm_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` as a persistent stream-K GEMM, optionally with the gated activation.

    Args:
        x: ``[M, K]`` bf16 (fp16/fp32 also run; fp32 multiplies in full precision), on a CUDA device
            (or any device under ``TRITON_INTERPRET=1``).
        w: ``[N, K]`` in ``x.dtype``, nn.Linear layout.
        bias: optional ``[N]`` in ``x.dtype``.
        act: None, or ``"silu"`` / ``"gelu_tanh"`` / ``"gelu"`` (erf): ``w`` is a merged ``[gate; up]``
            weight (N = 2D even, rows ``[0, D)`` gate) and the result is ``act(g) * u``.
        config: launch config; None takes :func:`pick_config`'s.

    Returns:
        ``[M, N]`` (``[M, N // 2]`` with ``act``) in ``x.dtype``, accumulated in fp32.

    Raises:
        TypeError: non-tensors, non-float or mismatched dtypes, a config that is not a GemmConfig.
        ValueError: wrong ranks or sizes, mismatched devices, a non-CUDA device outside the
            interpreter, an unknown ``act``, an odd N with ``act``, bad config sizes.
    """
    op = "gemm_bf16"
    V.floating(op, "x", x)
    V.ndim(op, "x", x, 2, "[M, K]")
    V.floating(op, "w", w)
    V.ndim(op, "w", w, 2, "[N, K]")
    V.same_dtype(op, "w", w, "x", x)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: w [N, K] has K={w.shape[1]} but x has K={x.shape[1]}")
    if bias is not None:
        V.floating(op, "bias", bias)
        V.ndim(op, "bias", bias, 1, "[N]")
        V.same_dtype(op, "bias", bias, "x", x)
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements but w has N={w.shape[0]} rows")
    V.same_device(op, "x", x, w=w, bias=bias)
    if x.device.type != "cuda" and not triton_interpreter():
        raise ValueError(f"{op}: x must be on a CUDA device (or run under TRITON_INTERPRET=1), got {x.device}")
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act must be None or one of {tuple(a for a in ACTIVATIONS if a)}, got {act!r}")
    M, K = x.shape
    N = w.shape[0]
    if act is not None and N % 2:
        raise ValueError(f"{op}: w [N, K] with act={act!r} needs an even N (gate; up), got N={N}")
    cfg = _check_config(pick_config(N, K, M, act) if config is None else config, act)
    nout = N // 2 if act is not None else N
    y = torch.empty((M, nout), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:  # nothing to multiply: bias (or zeros) through the activation
        return skinny_linear_ref(x, w, bias, act=act).to(x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    _launch(x, w, bias, y, act, cfg)
    return y


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, act: str | None,
            cfg: GemmConfig) -> None:  # fmt: skip
    M, K = x.shape
    nout = y.shape[1]
    code = ACTIVATIONS[act]
    bm, bk = cfg.block_m, cfg.block_k
    bn = cfg.block_n // 2 if code else cfg.block_n  # output columns per tile
    tiles = triton.cdiv(M, bm) * triton.cdiv(nout, bn)
    k_iters = triton.cdiv(K, bk)
    sched = _schedule(tiles, k_iters, cfg.programs or _num_sms(x.device), cfg.stream_k)
    use_tma = cfg.tma and _tma_ok(x, w)
    if use_tma:
        a_arg = TensorDescriptor.from_tensor(x, [bm, bk])
        b_arg = TensorDescriptor.from_tensor(w, [bn, bk])
    else:
        a_arg, b_arg = x, w
    if sched.sk_tiles:
        ws = torch.empty((2 * sched.programs, bm * bn * (2 if code else 1)), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, sched.sk_tiles)
    else:
        ws = cnt = y  # unused
    warps_threads = cfg.num_warps * 32
    # Rows per reduction chunk of the stream-K fixup: about 32 fp32 values per thread and operand.
    red_m = min(bm, triton.next_power_of_2(max(1, 32 * warps_threads // (bn * (2 if code else 1)))))
    _gemm_kernel[(sched.programs,)](
        a_arg, b_arg, bias if bias is not None else y, y, ws, cnt,
        M, nout, K, x.stride(0), w.stride(0), y.stride(0),
        sched.programs, sched.dp_tiles, sched.sk_base, sched.sk_rem, k_iters,
        ACT=code, HAS_BIAS=bias is not None, USE_TMA=use_tma, EVEN_K=K % bk == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        MAX_CONTRIB=sched.max_contrib, RED_M=red_m, NUM_THREADS=warps_threads,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
