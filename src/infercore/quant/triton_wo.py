"""Triton weight-only GEMV/GEMM kernels with the dequantization fused into the load.

* ``_gemv4_kernel`` -- small-M MODE 4, M <= 4 (decode): CUDA-core GEMV over INT4/INT8/FP8 weights
  repacked once into interleaved int32 words (``interleave_words``), per-thread accumulators
  reduced once, split-K finished inside the kernel, optional gated-activation epilogue (see the
  MODE 4 section below).
* ``_wq_small_kernel`` -- INT4/INT8 group-wise weights, M <= 16, MODE 1/2. One program owns
  ``BLOCK_N`` output channels and one K slice (split-K when the channel tiles alone cannot keep
  ~4 programs per SM in flight; fp32 partials then land in a workspace the wrapper sums). Each
  weight tile is loaded once (16-byte loads along K) and serves all M rows through a ``tl.dot``
  with the rows padded to 16 (``x @ w^T`` or the swapped ``w @ x^T``). Per K step of constant
  scale it forms ``sum_k q[n,k] x[k]`` and applies ``s * (. - z * sum_k x[k])``, so the zero
  point costs one multiply per group, not per weight. 4-bit codes are not interleaved back into
  K order; the even and odd activations are multiplied separately instead.
* ``_wq_gemm_kernel`` -- the same weights, larger M: codes -> ``(q - z) * s`` in the activation
  dtype -> ``tl.dot``.
* ``_fp8_small_kernel`` -- the same small-M structure (shared ``_small_*`` helpers) for the
  emulated FP8 weights below.
* ``_fp8_wo_kernel`` -- FP8 e4m3 weights *emulated*: the byte becomes an fp32 bit pattern by
  ``(x & 0x80) << 24 | (x & 0x7F) << 20`` (value times 2**-120, exact for normals and
  subnormals), the 2**120 is folded into the per-channel / per-block scale, then a bf16/fp16 dot.
  No FP8 instruction, so it runs on sm80.
* ``_gguf_kernel`` -- GGUF Q4_0/Q4_1/Q8_0 blocks read as stored (fp16 ``d``/``m`` assembled from
  bytes), dequantized in registers, then ``tl.dot``.

Autotuning runs on GPUs only; under ``TRITON_INTERPRET=1`` (CPU tests) each kernel has one config.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..devices import capability
from ..ops.activation import GATED_ACTS, gated_act_and_mul
from ..ops.linear.triton import ACTIVATIONS, _act_mul
from ..ops.pdl import GEMV_PREWAIT, pdl_enabled, pdl_launch, pdl_release, pdl_wait
from . import triton_frag as TF
from ._splitk import arrival_counters
from .formats import FP8_BLOCK, FP8Weight, GGUFWeight, IntWeight
from .gguf import BLOCK_BYTES
from .triton_dequant import _fp8_e4m3_bits_to_f32, dequant_fp8_triton, dequant_int_triton, use_dequant

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# INFERCORE_QUANT_AUTOTUNE=0 keeps only the first GPU config of each kernel (fast test runs).
_AUTOTUNE = os.environ.get("INFERCORE_QUANT_AUTOTUNE", "1") != "0"


def _mm_cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages)


_GGUF_QTYPE = {"q4_0": 0, "q4_1": 1, "q8_0": 2}


def _small_tile_cfgs() -> list[triton.Config]:
    """The INT and FP8 GEMMs' first candidates (16-row tiles); fresh objects per autotuner."""
    return [_mm_cfg(16, 64, 128, 4, 4), _mm_cfg(16, 32, 128, 4, 4), _mm_cfg(16, 128, 128, 4, 4)]


def _interp_cfg() -> triton.Config:
    return triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4)


# Up to this many rows the small-M (decode) kernels run; above, the tiled GEMMs.
SMALL_M_MAX = 16
# ... and up to this many the tensor-core words kernel (MODE 5) still runs where it can (INT4 / FP8 weights,
# 16-bit activations): its time barely grows with the rows, while the tiled GEMM took 2-3x bf16's time
# at 32-64 rows (results/h200/quant_wo_mid_m.json).
WORDS_M_MAX = 64
# Up to this many rows MODE 4 (the CUDA-core GEMV over int32 words) can run.
GEMV_M_MAX = 4


def _configs(gpu: list[triton.Config], interp: triton.Config) -> list[triton.Config]:
    if _INTERPRET:
        return [interp]
    return gpu if _AUTOTUNE else gpu[:1]


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 256)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return capability(device).multiprocessors  # cached: called on every small-M call
    return 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations (CPU tests, fp32 models) must not silently drop to tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _swizzle(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-tiles share each column tile while it is hot in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _gemm_tile(M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's ``[BLOCK_M, BLOCK_N]`` output tile (grouped order): row and channel offsets,
    their masks, and the int64 row offsets into x."""
    pid_m, pid_n = _swizzle(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N, offs_m.to(tl.int64)[:, None] * stride_xm


@triton.jit
def _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K: tl.constexpr):
    """Activations ``x[rows, k0 : k0 + BLOCK_K]`` as ``[BLOCK_M, BLOCK_K]``, zero past M and K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)


@triton.jit
def _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym):
    """``acc [BLOCK_M, BLOCK_N]`` -> ``y[offs_m, offs_n]`` (row stride ``stride_ym``) in y's dtype."""
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tile_dot(a, w, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a [BLOCK_M, BK]`` times ``w [BLOCK_N, BK]``: MODE 1 ``a @ w^T`` ``[BLOCK_M, BLOCK_N]``;
    MODE 2 ``w @ a^T`` ``[BLOCK_N, BLOCK_M]`` ("swap AB": the decoded weights are the
    register-resident A operand and the wide BLOCK_N fills the MMA's M dimension)."""
    if MODE == 1:
        part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    else:
        part = tl.dot(w, tl.trans(a), input_precision=DOT_PRECISION)
    return part


@triton.jit
def _tile_dot_acc(a, w, acc, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + _tile_dot(a, w)`` as one accumulating dot."""
    if MODE == 1:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _chan(v, MODE: tl.constexpr):
    """Per-channel ``v [BLOCK_N]`` broadcast against a tile in MODE's orientation."""
    if MODE == 2:
        r = v[:, None]
    else:
        r = v[None, :]
    return r


@triton.jit
def _row(v, MODE: tl.constexpr):
    """Per-row ``v [BLOCK_M]`` broadcast against a tile in MODE's orientation."""
    if MODE == 2:
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _small_setup(M, N, stride_xm, stride_qn, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(n, s)`` of a small-M kernel: channel and row offsets, their masks, the int64 row
    offsets into the weights and x, and a zero fp32 accumulator in MODE's orientation."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if MODE == 2:  # stays in the MMA's orientation until the store
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return (offs_n, offs_n < N, offs_m, offs_m < M, offs_n.to(tl.int64)[:, None] * stride_qn,
            offs_m.to(tl.int64)[:, None] * stride_xm, acc)


@triton.jit
def _small_w(qw_ptr, rows_w, n_mask, kb0, KB, BLOCK: tl.constexpr):
    """Weight bytes ``[BLOCK_N, BLOCK]`` from byte ``kb0`` of each row (``KB`` bytes per row)."""
    offs_b = kb0 + tl.arange(0, BLOCK)
    # Weights are read once per call: evict them first so x and the scales stay cached.
    return tl.load(qw_ptr + rows_w + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < KB), other=0,
                   eviction_policy="evict_first")


@triton.jit
def _small_store(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym, MODE: tl.constexpr):
    """Store a MODE-oriented accumulator as ``y[offs_m, offs_n]``."""
    if MODE == 2:
        acc = tl.trans(acc)
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, stride_sn, g, HAS_ZEROS: tl.constexpr, BITS: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Group ``g``'s scales ``[BLOCK_N]`` and zero points as fp32 (``2**(BITS-1)`` when symmetric)."""
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
    else:
        z = tl.full([BLOCK_N], 2 ** (BITS - 1), dtype=tl.float32)
    return s, z


@triton.jit
def _int4_nibbles(b, like, MAGIC: tl.constexpr):
    """Low and high nibbles of the bytes ``b`` as dot operands. MAGIC 0 (fp32 activations: a 2**23
    offset would swamp fp32 products): exact small integers, converted. Else each nibble is OR-ed
    into the mantissa of MAGIC_BASE, giving ``MAGIC_BASE + code`` in ``like``'s 16-bit dtype
    exactly and without a convert instruction; callers subtract ``MAGIC_BASE`` with the zero point."""
    if MAGIC == 0:
        lo = (b & 15).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
    else:
        lo = ((b.to(tl.int16) & 15) | MAGIC).to(like.dtype, bitcast=True)
        hi = ((b.to(tl.int16) >> 4) | MAGIC).to(like.dtype, bitcast=True)
    return lo, hi


# ----------------------------------------------------------------------------------------------
# INT4 / INT8 weight-only
# ----------------------------------------------------------------------------------------------


@triton.jit
def _wq_small_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, KP, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, MODE: tl.constexpr,
    MAGIC: tl.constexpr, MAGIC_BASE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small-M (decode) INT4/INT8 weight-only on tensor cores; every weight tile serves all M rows.

    Grid ``(cdiv(N, BLOCK_N), SPLIT)``: program ``(n, s)`` owns ``BLOCK_N`` channels and the K range
    ``[s * k_per_split, (s+1) * k_per_split)``; with ``SPLIT > 1`` it writes fp32 partials to slice
    ``s`` of ``y`` (stride ``stride_ys``). ``BLOCK_K <= GROUP``, so one scale/zero per channel
    per step, applied to the step's partial sums, never per weight. The rows are padded to
    ``BLOCK_M >= 16``; MODE 1 / MODE 2 as in ``_tile_dot``.
    """
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    offs_n, n_mask, offs_m, m_mask, rows_w, rows_x, acc = _small_setup(M, N, stride_xm, stride_qn, MODE,
                                                                       BLOCK_M, BLOCK_N)
    pid_k = tl.program_id(1)
    # Byte offsets (not k // 2) so alignment analysis can prove 16-byte loads along K.
    kb_start = pid_k * (k_per_split // PACK)
    kb_end = tl.minimum(kb_start + k_per_split // PACK, KP // PACK)
    for kb0 in range(kb_start, kb_end, BLOCK_K // PACK):
        k0 = kb0 * PACK
        s, z = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, stride_sn, k0 // GROUP, HAS_ZEROS, BITS, BLOCK_N)
        b = _small_w(qw_ptr, rows_w, n_mask, kb0, KP // PACK, BLOCK_K // PACK)
        a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        if BITS == 4:
            # Even and odd K go to separate products, so nibbles never need interleaving; the
            # activations are loaded as vectors and split (the dot converts layouts anyway).
            ae, ao = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
            lo, hi = _int4_nibbles(b, ae, MAGIC)
            if MAGIC == 0:
                zb = z
            else:
                zb = z + MAGIC_BASE
            part = _tile_dot(ae, lo, MODE, DOT_PRECISION)
            part = _tile_dot_acc(ao, hi, part, MODE, DOT_PRECISION)
            asum = tl.sum(ae.to(tl.float32), axis=1) + tl.sum(ao.to(tl.float32), axis=1)
        else:
            q = b.to(tl.float32).to(a.dtype)  # codes <= 255: exact in bf16/fp16
            part = _tile_dot(a, q, MODE, DOT_PRECISION)
            zb = z
            asum = tl.sum(a.to(tl.float32), axis=1)
        # sum_k (q - z) x = sum_k q x - z sum_k x: the zero point costs one FMA per step, not per weight.
        acc += (part - _chan(zb, MODE) * _row(asum, MODE)) * _chan(s, MODE)
    _small_store(y_ptr + pid_k.to(tl.int64) * stride_ys, acc, offs_m, m_mask, offs_n, n_mask, stride_ym, MODE)


@triton.autotune(
    configs=_configs(
        [
            *_small_tile_cfgs(),
            _mm_cfg(64, 128, 64, 4, 4),
            _mm_cfg(128, 128, 64, 8, 4),
            _mm_cfg(128, 256, 64, 8, 3),
        ],
        _interp_cfg(),
    ),
    key=["M_BUCKET", "N", "KP", "BITS", "GROUP"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune_wq(cfgs, {**nargs, **kw})},
)
@triton.jit
def _wq_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K, KP, M_BUCKET,
    stride_xm, stride_qn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MAGIC: tl.constexpr, MAGIC_BASE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_mask, n_mask, rows_x = _gemm_tile(M, N, stride_xm, BLOCK_M, BLOCK_N, GROUP_M)
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    for kb0 in range(0, KP // PACK, BLOCK_K // PACK):  # byte offsets: provably aligned loads
        k0 = kb0 * PACK
        # BLOCK_K <= GROUP: one scale per channel per step
        s, z = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, stride_sn, k0 // GROUP, HAS_ZEROS, BITS, BLOCK_N)
        if BITS == 4:
            # Even and odd K in two dots, so nibbles never need interleaving; the dot of the
            # activations with MAGIC_BASE + z is subtracted after.
            offs_b = kb0 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(qw_ptr + rows_w + offs_b[None, :],
                        mask=n_mask[:, None] & (offs_b[None, :] < KP // 2), other=0)
            a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
            ae, ao = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
            lo, hi = _int4_nibbles(b, ae, MAGIC)
            part = _tile_dot(ae, lo, 1, DOT_PRECISION)
            part = _tile_dot_acc(ao, hi, part, 1, DOT_PRECISION)
            asum = tl.sum(ae.to(tl.float32), axis=1) + tl.sum(ao.to(tl.float32), axis=1)
            part -= asum[:, None] * (z + MAGIC_BASE)[None, :]
        else:
            a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < KP),
                        other=0)
            w = (q.to(tl.float32) - z[:, None]).to(a.dtype)  # |q - z| <= 255: exact in bf16/fp16
            part = _tile_dot(a, w, 1, DOT_PRECISION)
        acc += part * s[None, :]
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


# (pattern, value) of the magic float into whose mantissa a 4-bit code is OR-ed, per activation dtype.
_MAGIC = {torch.float32: (0, 0.0), torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def _prune_wq(configs, nargs):
    group = nargs["GROUP"]
    out = [c for c in configs if c.kwargs["BLOCK_K"] <= group]
    m = nargs["M_BUCKET"]
    small = [c for c in out if c.kwargs["BLOCK_M"] <= max(16, m)]
    if small or out:
        return small or out
    c = configs[0]  # every tile is longer than a group: shrink the first one's K step
    return [triton.Config({**c.kwargs, "BLOCK_K": group}, num_warps=c.num_warps, num_stages=c.num_stages)]


def _kernel_group(w: IntWeight) -> int:
    # Per-channel (one group spanning K): any power of two >= Kp keeps every sub-block inside it.
    if w.scales.shape[1] == 1:
        return max(triton.next_power_of_2(w.padded_in_features), 64)
    return w.group_size


def _check_x(fn: str, x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as a 2-D fp32/fp16/bf16 ``[M, k]`` tensor with unit stride along K (copied if not)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _MAGIC:
        raise TypeError(f"{fn}: x must be a fp32/fp16/bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{fn}: x must be [M, {k}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def wq_matmul_triton(
    x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None, *, config: dict | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times INT4/INT8 ``w`` (logical ``[N, K]``) -> ``[M, N]`` in
    ``x.dtype``.

    ``bias``: optional ``[N]``. ``config`` (the small-M path only, see ``_small_rows``; benchmarks/sweeps):
    the small-M launch parameters ``{"MODE", "BLOCK_N", "BLOCK_K", "SPLIT", "num_warps", "num_stages"}``
    (see ``_small_cfg``) instead of the tuned table / heuristic.
    ``act`` (``"silu"``, ``"gelu_tanh"``, ``"gelu"``): ``w`` is a merged ``[gate; up]`` weight and the
    result is ``act(gate) * up`` ``[M, N // 2]``, in MODE 4's epilogue when that path runs (no bias),
    else as the ``*_and_mul`` op after the product.
    """
    _check_act(act, w.shape[0])
    if w.group_size & (w.group_size - 1) and w.scales.shape[1] != 1:
        raise ValueError(f"w: Triton kernels need a power-of-two group size, got {w.group_size}")
    n, k = w.shape
    x = _check_x("wq_matmul_triton", x, k)
    m = x.shape[0]
    kp = w.padded_in_features
    group = _kernel_group(w)
    zeros = w.zeros if w.zeros is not None else w.scales
    fused = act if bias is None else None
    y = _run_mode6("int4", x, w, n, kp, config, fused, TF.int4_ok, TF.int4_matmul)
    if y is not None:
        if fused is not None:
            return y
    elif _small_rows(f"int{w.bits}", x, w.qweight, group):
        ilv = min(group, ILV_CODES)
        cfg, words = _small_plan(f"int{w.bits}", x, w.qweight, n, kp, group, config,
                                 lambda: interleave_words(_pad_codes(w.codes(), ilv), w.bits, ilv))
        if words is not None and cfg["MODE"] == 4:
            cpw = 32 // w.bits
            y = _launch_gemv4(x, words, n, cfg, w.scales, zeros, w.scales.stride(0), fused, FP8=False, BITS=w.bits,
                              ILV=ilv // cpw, SCALE_WORDS=group // cpw, SCALE_ROWS=0,
                              HAS_ZEROS=w.zeros is not None)
            if fused is not None:
                return y
        elif cfg["MODE"] == 5:
            y = _launch_words(x, w.qweight, w.scales, zeros, n, kp, cfg, FP8=False, GROUP=group,
                              HAS_ZEROS=w.zeros is not None, SCALE_BLOCK=0, MAGIC=_MAGIC[x.dtype][0],
                              MAGIC_BASE=_MAGIC[x.dtype][1], FOLD=1.0)
        else:
            y = _launch_small(_wq_small_kernel, x, w.qweight, (w.scales, zeros), (k, kp), n, kp, cfg,
                              BITS=w.bits, GROUP=group, HAS_ZEROS=w.zeros is not None,
                              MAGIC=_MAGIC[x.dtype][0], MAGIC_BASE=_MAGIC[x.dtype][1])
    elif use_dequant(x, f"int{w.bits}"):  # many rows: decode the weight once, then cuBLAS (triton_dequant)
        y = F.linear(x, dequant_int_triton(w, x.dtype))
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _wq_gemm_kernel[grid](
            x, w.qweight, w.scales, zeros, y, m, n, k, kp, _m_bucket(m),
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), y.stride(0),
            BITS=w.bits, GROUP=group, HAS_ZEROS=w.zeros is not None, DOT_PRECISION=_dot_precision(x.dtype),
            MAGIC=_MAGIC[x.dtype][0], MAGIC_BASE=_MAGIC[x.dtype][1],
        )
    return _apply_act(y if bias is None else y + bias.to(y.dtype), act)


def _check_act(act: str | None, n: int) -> None:
    if act is not None and (act not in GATED_ACTS or n % 2):
        raise ValueError(f"act: expected one of {GATED_ACTS} with an even N, got {act!r} with N = {n}")


def _apply_act(y: torch.Tensor, act: str | None) -> torch.Tensor:
    """The gated activation of a merged ``[gate; up]`` product (the unfused path)."""
    return y if act is None else gated_act_and_mul(y, act)



# MODE 5's default tile (M = 2..16, or shapes not in the table) and MODE 2's, where MODE 5 cannot run.
_MODE5_DEFAULT = {"MODE": 5, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}
_MODE2_DEFAULT = {"MODE": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}

def _packed4(bn: int, bk: int, warps: int, stages: int, split: int) -> dict:
    """A MODE 4 table entry with the packed fp16 dot (``_packed_rows``)."""
    return {"MODE": 4, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SPLIT": split,
            "PACKED": True}


# Small-M launch table: (kind, N, K, M bucket) -> config, from benchmarks/sweep_quant_wo.py on an
# H200 (its "table" output). Missing entries use the heuristic in ``_small_cfg``.
SMALL_M_TUNED: dict[tuple[str, int, int, int], dict] = {
    # benchmarks/sweep_quant_wo.py on the H200: results/h200/quant_wo_small_m.json; the MODE 4 "PACKED" entries
    # (FP8 at M = 1, 2; INT4 at M = 2 and o_proj's M = 4) from its --grid packed runs,
    # results/h200/sweeps/sweep_packed_fp8.json and sweep_packed_rows_int4.json (fifteenth session)
    ("int4", 14336, 4096, 1): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 14336, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 14336, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 14336, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 14336, 4096, 2): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 14336, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 14336, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 6144, 4096, 1): {'MODE': 4, 'BLOCK_N': 8, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 2, 'SPLIT': 0},
    ("int4", 6144, 4096, 2): _packed4(4, 1024, 1, 2, 1),
    ("int4", 6144, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("int4", 6144, 4096, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 6144, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 6144, 4096, 2): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 6144, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 6144, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 4096, 4096, 1): {'MODE': 4, 'BLOCK_N': 4, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 1, 'SPLIT': 1},
    ("int4", 4096, 4096, 2): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 4096, 4): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 4096, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 4096, 1): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 4096, 4096, 2): _packed4(8, 2048, 4, 2, 1),
    ("fp8", 4096, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 1): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 28672, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 28672, 4096, 1): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 28672, 4096, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 1},
    ("fp8", 28672, 4096, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 1},
    ("int4", 4096, 14336, 1): {'MODE': 4, 'BLOCK_N': 4, 'BLOCK_K': 2048, 'num_warps': 2, 'num_stages': 1, 'SPLIT': 1},
    ("int4", 4096, 14336, 2): _packed4(8, 2048, 2, 2, 0),
    ("int4", 4096, 14336, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 16},
    ("int4", 4096, 14336, 16): {'MODE': 5, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 1): _packed4(4, 2048, 4, 2, 0),
    ("fp8", 4096, 14336, 2): _packed4(8, 2048, 4, 2, 0),
    ("fp8", 4096, 14336, 4): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 16): {'MODE': 5, 'BLOCK_N': 128, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
}


# MODE 6 (``triton_frag``: weights stored as MMA fragments) where the H200 sweep measured it faster than
# the table above (``python benchmarks/sweep_frag.py --kinds int4 --wn also``; the tiles below are from
# results/h200/quant_wo_mode6_one_mma.json, the kernel with one MMA per word and, with WN, the MMAs of a
# group chained before its scale): INT4 at M <= 4 on the MLP and qkv shapes, and the merged gate_up at
# M <= 16 (34.2 vs 38.4 us for MODE 5 at M=16). It loses on o_proj, at M = 16 elsewhere and for FP8,
# which keep MODEs 4 / 5. "WN": the warps split N (``triton_frag._frag_kernel``'s WN). A None entry: MODE 4's
# packed INT4 dot wins at that M (fourteenth session, results/h200/sweeps/sweep_mode4_packed.json).
# 14336x4096: M=1 14.1 us (bf16 32.7, tinygemm 18.0), M=4 17.3; 28672x4096 M=1 23.1, M=4 25.8
# (4096x14336 M=1 16.0, M=4 20.3 and 6144x4096 M=1 9.8, M=4 11.7 before the None entries below).
MODE6_TUNED: dict[tuple[str, int, int, int], dict | None] = {
    # M=1 on the MLP shapes (sixteenth session, results/h200/sweeps/probe_frag_depth.json, alternating rounds):
    # DEPTH 3 (no register rotation) under a 128-register cap, 13.70 vs 13.99 us and 21.89 vs 23.14 us for
    # the DEPTH 2 tiles before; M=4 on 14336x4096 eight warps, 16.85 vs 17.26 us; M=2 there the warps splitting
    # K at DEPTH 3 (sweeps/probe_frag_depth_caps.json).
    ("int4", 14336, 4096, 1): {'WN': 1, 'WARPS': 2, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 3, 'MAXNREG': 128},
    ("int4", 14336, 4096, 2): {'WARPS': 4, 'REPS': 4, 'SPLIT': 1, 'DEPTH': 3},  # 15.59 vs 16.85 us (_caps.json)
    ("int4", 14336, 4096, 4): {'WN': 1, 'WARPS': 8, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 2},
    ("int4", 28672, 4096, 1): {'WN': 1, 'WARPS': 4, 'REPS': 4, 'SPLIT': 8, 'DEPTH': 3, 'MAXNREG': 128},
    ("int4", 28672, 4096, 4): {'WARPS': 4, 'REPS': 4, 'SPLIT': 1, 'DEPTH': 1},
    ("int4", 28672, 4096, 16): {'WN': 1, 'WARPS': 2, 'REPS': 4, 'SPLIT': 4, 'DEPTH': 1},
    ("int4", 4096, 14336, 1): None,  # MODE 4 PACKED: 14.4 vs 16.4 us
    # (M 2 there: MODE 4's packed dot at 2 rows, 19.0 / 9.4 us; M 3-4: MODE 5 on the stored words, 21.9 / 13.8 us
    # against MODE 6's 20.3 / 11.7, so that a weight keeps one repacked copy: results/h200/quant_wo_dispatch.json,
    # quant_wo_small_m.json, quant_wo_mode6_one_mma.json)
    ("int4", 4096, 14336, 4): None,
    ("int4", 6144, 4096, 1): None,  # MODE 4 PACKED: 7.3 vs 9.8 us
    ("int4", 6144, 4096, 4): None,
}


def _tuned(table: dict, kind: str, n: int, k: int, m: int, borrow: int) -> tuple[bool, dict | None]:
    """``table``'s entry for this shape and M bucket: the first of the bucket and ``borrow`` larger ones
    present (an unswept bucket borrows the next larger one's tile). ``(found, entry)``; an entry may be
    None (MODE6_TUNED: not MODE 6 there)."""
    mb = triton.next_power_of_2(m)
    key = next(((kind, n, k, mb << i) for i in range(borrow + 1) if (kind, n, k, mb << i) in table), None)
    return (False, None) if key is None else (True, table[key])


# Untuned INT4 shapes run MODE 6 at M=1 from this many channels and bytes of codes (``TF.m1_config``: the
# warps splitting N, DEPTH 3 under a 128-register cap). On the H200 it beat MODE 4 on 14336x4096 and
# 28672x4096 (MODE6_TUNED), on the 128256-row lm_head (73.9 vs 107.2 us for MODE 4's best tile,
# sweeps/probe_lm_head.json), 8192x8192 (14.8 vs 16.7) and 10240x8192 (18.4 vs 20.7); MODE 4 won on 4096
# or 6144 channels and on 8192x4096 (9.8 vs 11.3 us; sweeps/probe_untuned_int4.json).
MODE6_MIN_N = 8192
MODE6_MIN_BYTES = 24 << 20


# MODE 7 (``gluon_frag``: MODE 6's fragments streamed by TMA, one warp per 64-channel block; sm90+) where the
# H200 probe measured it faster than the MODE 6 entry above (seventeenth session,
# results/h200/sweeps/probe_tma_frag_w.json, alternating rounds): 14336x4096 M=1 13.09 vs 13.73 us, M=2 14.31
# vs 15.62, M=4 15.23 vs 16.93; the merged gate_up with SiLU M=1 20.15 vs 22.11, M=4 22.16 vs 32.76. It lost
# on down, qkv, o_proj and the lm_head (fewer channel blocks: a warp's groups run one after another) and tied
# at M=16. Same repacked words as MODE 6, so a weight still keeps one copy; on GPUs before sm90 the MODE 6
# entries run. With the eighteenth session's split-K finishes (unrolled; tagged at M <= 2) the dispatcher reads
# 11.05 / 11.88 / 14.65 / 20.32 us at M = 1 / 2 / 4 / 16 on 14336x4096 and 18.89 / 20.64 on the merged gate_up
# at M = 1 / 4 (results/h200/quant_wo_dispatch.json). Nineteenth session: with more splits (4 groups or fewer
# per warp, so ~1800 one-warp programs keep the loads in flight) MODE 7 also wins on down and qkv, and at M 5-8
# on 14336x4096 (results/h200/sweeps/probe_mode7_small_shapes.json, probe_mode7_down_m.json,
# probe_mode7_kmajor.json; alternating rounds against the dispatcher's MODE 4 / 5): down M = 1 / 2 / 4 / 8 / 16
# 12.41 / 13.44 / 15.38 / 16.01 / 20.47 us vs 14.35 / 18.99 / 23.97 / 22.54 / 22.50; qkv M = 1 / 2 / 4 7.18 /
# 8.16 / 8.81 vs 7.31 / 9.51 / 10.50, M=8 9.94 vs 12.25 (probe_mode7_more.json; M=16: 13.40 vs MODE 5's 12.51);
# 14336x4096 M=8 14.38 vs 21.35. o_proj stays on MODE 4: MODE 7 wins at M = 2 / 4 (6.87 / 8.84 vs 7.13 / 10.12)
# but loses at M=1 (6.42 vs 5.29), and a weight keeps one repacked copy.
MODE7_TUNED: dict[tuple[str, int, int, int], dict | None] = {
    ("int4", 14336, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 14336, 4096, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    # M 9-16 (two B fragments) after the unrolled finish, eighteenth session: 20.19 vs 22.03 us for MODE 5
    # (results/h200/sweeps/probe_tma_frag_after_finish.json, alternating rounds)
    ("int4", 14336, 4096, 16): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 28672, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 28672, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 4096, 14336, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 28},
    ("int4", 4096, 14336, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 4096, 14336, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 4096, 14336, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 4096, 14336, 16): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 6144, 4096, 1): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 32},
    ("int4", 6144, 4096, 2): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 16},
    ("int4", 6144, 4096, 4): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 8},
    ("int4", 6144, 4096, 8): {"MODE": 7, "W": 1, "STAGES": 2, "SPLIT": 4},
    ("int4", 6144, 4096, 16): None,  # MODE 5
}


def _mode6_entry(kind: str, n: int, k: int, m: int, num_sms: int, mode7: bool = False) -> dict | None:
    """The fragment kernels' launch entry for this shape and M: ``MODE7_TUNED`` when ``mode7`` (MODE 7 can run
    here), else ``MODE6_TUNED``, else ``TF.m1_config`` for INT4 at M=1 from ``MODE6_MIN_N`` channels and
    ``MODE6_MIN_BYTES`` of codes; None where neither runs by default."""
    if mode7:
        found, entry = _tuned(MODE7_TUNED, kind, n, k, m, 2)
        if found:
            return entry
    found, entry = _tuned(MODE6_TUNED, kind, n, k, m, 2)
    if not found and kind == "int4" and m == 1 and n >= MODE6_MIN_N and n * k // 2 >= MODE6_MIN_BYTES:
        return TF.m1_config(n, k, num_sms)
    return entry


def _mode7_ok(kind: str, x: torch.Tensor, w=None) -> bool:
    """Whether MODE 7 can run for ``x``: CUDA sm90+ (TMA), a Triton with Gluon, and INT4 or per-channel FP8
    ``w`` (None: not checked)."""
    per_channel = w is None or kind != "fp8" or w.block_size is None
    return per_channel and capability(x.device).at_least(9) and TF.gluon_available()


def repacked_layouts(kind: str, n: int, k: int) -> set[str]:
    """The repacked copies the tuned tables make for a ``[n, k]`` weight (``kind`` "int4" / "fp8") over
    M = 1..SMALL_M_MAX on a GPU: "mode4" (``interleave_words``) and / or "mode6" (``triton_frag``'s
    fragments). The tables keep it to one per weight (each costs 0.5 B/param INT4, 1 B/param FP8;
    tests/quant/test_triton_wo_small_m.py)."""
    out = set()
    for m in range(1, SMALL_M_MAX + 1):
        # (the SM count sets only the split, not whether; MODE 7 runs on MODE 6's words)
        if _mode6_entry(kind, n, k, m, 132) is not None or _tuned(MODE7_TUNED, kind, n, k, m, 2)[1] is not None:
            out.add("mode6")
        elif m <= GEMV_M_MAX:
            found, cfg = _tuned(SMALL_M_TUNED, kind, n, k, m, 4)
            if (cfg["MODE"] if found else 4 if m == 1 else 5) == 4:  # (as _small_cfg without a table entry)
                out.add("mode4")
    return out


def _mode6_cfg(kind: str, x: torch.Tensor, n: int, k: int, override: dict | None, runnable, w=None) -> dict | None:
    """The fragment kernels' launch config when one runs this call (``override`` MODE 6 or 7, or a
    ``MODE7_TUNED`` / ``MODE6_TUNED`` entry for this shape and M bucket when ``runnable()``), else None. An
    override asking for MODE 6 / 7 where it cannot run raises."""
    m = x.shape[0]
    if override is not None:
        if override.get("MODE") not in (6, 7):
            return None
        if not runnable():
            raise ValueError(f"config: MODE {override['MODE']} cannot run here (CUDA sm80+, 16-bit activations, "
                             "M <= 16, and the weight shape / group the fragment layout needs)")
        if override["MODE"] == 7:
            if not _mode7_ok(kind, x, w):
                raise ValueError("config: MODE 7 runs INT4 and per-channel FP8 weights on CUDA sm90+ with a Triton "
                                 "that has Gluon")
            return dict(override)
        return {**TF.default_config(kind, n, k, m, _num_sms(x.device)), **override}
    if m > SMALL_M_MAX or _INTERPRET or not x.is_cuda or not REPACK:  # MODE 6 repacks like MODE 4
        return None
    # (None: neither for this shape and bucket)
    tuned = _mode6_entry(kind, n, k, m, _num_sms(x.device), _mode7_ok(kind, x, w))
    if tuned is None or not runnable():
        return None
    if tuned.get("MODE") == 7:
        return dict(tuned)
    return {**TF.default_config(kind, n, k, m, _num_sms(x.device)), **tuned}


def _run_mode6(kind: str, x: torch.Tensor, w, n: int, k: int, config: dict | None, act: str | None, ok, run):
    """MODE 6's result when it runs this call (see ``_mode6_cfg``), else None (the caller's other
    kernels run). Its repack is made on a first eager call: a call captured into a CUDA graph before
    one falls back, unless MODE 6 was asked for by ``config``, which then raises."""
    cfg = _mode6_cfg(kind, x, n, k, config, lambda: ok(x, w, act), w)
    if cfg is None:
        return None
    y = run(x, w, cfg, act)
    if y is None and config is not None:
        raise ValueError("config: MODE 6's weight repack is made on the first eager call; run one before "
                         "capturing a CUDA graph")
    return y


def _small_cfg(kind: str, n: int, kp: int, m: int, kmax: int, device: torch.device,
               override: dict | None) -> dict:
    """Launch parameters of the small-M kernels; ``kmax`` caps BLOCK_K (group / scale block).

    Keys: MODE (1 dot, 2 swapped dot, 4 word GEMV for M <= GEMV_M_MAX, 5 swapped dot over the stored
    words, two codes per instruction), BLOCK_N, BLOCK_K (codes per tile; MODE 1/2/5 tiles stay inside
    one group, MODE 4 tiles span groups), SPLIT (0: heuristic),
    num_warps, num_stages.
    """
    mb = triton.next_power_of_2(m)
    if override is not None:
        if override.get("MODE") not in (1, 2, 4, 5):  # MODE 6 / 7 are taken before (``_run_mode6``)
            raise ValueError(f"config: MODE must be 1, 2, 4, 5, 6 or 7, got {override.get('MODE')!r}")
        cfg = dict(override)
    elif _INTERPRET:
        cfg = {"MODE": 4 if m <= GEMV_M_MAX else 2, "BLOCK_N": 8, "BLOCK_K": 64, "SPLIT": 0,
               "num_warps": 4, "num_stages": 1}
    elif _tuned(SMALL_M_TUNED, kind, n, kp, m, 4)[0]:  # (an unswept bucket borrows a larger one's tile)
        cfg = dict(_tuned(SMALL_M_TUNED, kind, n, kp, m, 4)[1])
        if cfg["MODE"] == 4 and m > GEMV_M_MAX:
            cfg = dict(_MODE5_DEFAULT)
    elif m == 1:
        # The tile the H200 sweep picked on most Llama-8B shapes (results/h200/quant_wo_small_m.json):
        # 4 channels x 2048 codes per step, 2-stage pipelined K loop; at M = 2..4 the swapped dot won.
        # INT4 takes 8 channels on 2 warps, the packed dot's tile (qkv's entry): with 4 warps a 2048-code
        # step is too short for the packed dot, and the fp32 path it falls back to read the 128256-row
        # lm_head in 286 us against 107 (sweeps/probe_lm_head.json).
        cfg = {"MODE": 4, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT": 0, "num_warps": 4, "num_stages": 2}
        if kind == "int4":
            cfg.update(BLOCK_N=8, num_warps=2)
    else:  # the tile the H200 sweep picked for M = 2..16 on most shapes (MODE 2 where MODE 5 cannot run)
        cfg = dict(_MODE5_DEFAULT)
    if cfg["MODE"] != 4:  # MODE 4 tiles span groups (per-word scales)
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], kmax)
    cfg["BLOCK_M"] = mb if cfg["MODE"] == 4 else max(16, mb)
    if cfg["MODE"] == 4:
        cfg.setdefault("SPLIT", 0)  # 0: chosen at launch (_gemv_split)
    elif not cfg.get("SPLIT"):
        # Split K until programs cover the multiprocessors ~4 times (MODE 5, whose programs are
        # larger: ~2 times), keeping >= 4 steps per split.
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        waves = 2 if cfg["MODE"] == 5 else 4
        split = 1
        while split < 16 and tiles * split < waves * _num_sms(device) and kp // (2 * split) >= 4 * cfg["BLOCK_K"]:
            split *= 2
        cfg["SPLIT"] = split
    return cfg


@triton.jit
def _sum_splits_kernel(ws_ptr, y_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + i * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _finish_splits(ws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 split-K partials ``[split, m, n]`` -> their sum ``[m, n]`` in ``dtype``: one launch
    (not a sum and a cast), which matters at decode where each kernel is a few microseconds."""
    if ws.shape[0] == 1:
        return ws[0]
    y = torch.empty(ws.shape[1:], dtype=dtype, device=ws.device)
    numel = y.numel()
    _sum_splits_kernel[(triton.cdiv(numel, 1024),)](ws, y, numel, SPLIT=ws.shape[0], BLOCK=1024)
    return y


def _small_out(x: torch.Tensor, m: int, n: int, k: int, cfg: dict) -> tuple[torch.Tensor, int, int]:
    """Output (or fp32 split-K workspace ``[split, m, n]``), split count, K per split."""
    bk = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["SPLIT"]), bk) * bk
    split = triton.cdiv(k, k_per_split)
    ws = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    return ws, split, k_per_split


def _small_plan(kind: str, x: torch.Tensor, qweight: torch.Tensor, n: int, kdim: int, kmax: int,
                config: dict | None, make_ilv) -> tuple[dict, torch.Tensor | None]:
    """Small-M config and, when it is the MODE 4 GEMV and can run (M <= GEMV_M_MAX and its
    interleaved words exist or may be made now, by ``make_ilv()``), the int32 words; otherwise
    ``None`` and a tensor-core config (MODE 5 where it can run, see ``_mode5_ok``, else MODE 1/2)."""
    m = x.shape[0]
    cfg = _small_cfg(kind, n, kdim, m, kmax, x.device, config)
    if cfg["MODE"] == 5 and not _mode5_ok(kind, x, qweight, cfg["BLOCK_K"]):
        cfg = _small_cfg(kind, n, kdim, m, kmax, x.device, dict(_MODE2_DEFAULT))
    if cfg["MODE"] != 4:
        return cfg, None
    words = _ilv_cached(qweight, make_ilv) if m <= GEMV_M_MAX else None
    if words is None:  # not runnable (see above): the tensor-core path
        ok = _mode5_ok(kind, x, qweight, min(_MODE5_DEFAULT["BLOCK_K"], kmax))
        cfg = _small_cfg(kind, n, kdim, m, kmax, x.device, dict(_MODE5_DEFAULT if ok else _MODE2_DEFAULT))
    return cfg, words


def _small_rows(kind: str, x: torch.Tensor, qweight: torch.Tensor, kmax: int) -> bool:
    """Whether the small-M kernels take ``x``: up to SMALL_M_MAX rows, or WORDS_M_MAX where MODE 5 runs."""
    m = x.shape[0]
    return m <= SMALL_M_MAX or (m <= WORDS_M_MAX and _mode5_ok(kind, x, qweight, min(_MODE5_DEFAULT["BLOCK_K"], kmax)))


def _mode5_ok(kind: str, x: torch.Tensor, qweight: torch.Tensor, block_k: int) -> bool:
    """MODE 5 runs INT4 and FP8 (an INT8 code does not fit a bf16 mantissa) with 16-bit activations,
    rows of whole 4-byte aligned words, and K steps of >= 16 pairs (the dot's minimum depth)."""
    return kind in ("int4", "fp8") and _words_ok(x, qweight) and block_k >= 8 * (4 if kind == "fp8" else 8)


def _launch_small(kernel, x: torch.Tensor, qweight: torch.Tensor, tensors: tuple, sizes: tuple, n: int,
                  kdim: int, cfg: dict, **meta) -> torch.Tensor:
    """Run a MODE 1/2 small-M kernel over ``kdim`` codes per row and sum its split-K partials.

    Kernel arguments: ``x, qweight, *tensors, ws, M, N, *sizes, k_per_split``, then the strides of
    x, qweight, ``tensors[0]`` (the scales) and the workspace's rows and splits.
    """
    m = x.shape[0]
    ws, split, kps = _small_out(x, m, n, kdim, cfg)
    kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x, qweight, *tensors, ws, m, n, *sizes, kps,
        x.stride(0), qweight.stride(0), tensors[0].stride(0), ws.stride(1), ws.stride(0),
        MODE=cfg["MODE"], DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **meta,
    )
    return _finish_splits(ws, x.dtype)


@triton.jit
def _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N,
                 SPLIT_K: tl.constexpr, NSPLIT: tl.constexpr):
    """Store ``acc [BLOCK_M, BLOCK_N]``; with split-K the last program of a column tile to arrive
    sums the fp32 partials (no second launch: at decode a launch costs as much as the GEMV)."""
    pid_n = tl.program_id(0)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K:
        pid_k = tl.program_id(1)
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            tot = tl.zeros_like(acc)
            for s in tl.static_range(NSPLIT):  # unrolled: every split's load in flight at once
                tot += tl.load(ws_ptr + s * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            # ready for the next launch (graph replays too); the launch's end publishes it
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_zeros(BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Four per-thread fp32 accumulators ``[BLOCK_N, BLOCK_KW]``, one per row."""
    return (tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32),
            tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32))


@triton.jit
def _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, s, BLOCK_M: tl.constexpr, SCALED: tl.constexpr):
    """``a_r += p_r * s`` (``a_r += p_r`` unless SCALED) for the rows ``r < BLOCK_M``."""
    if SCALED:
        a0 += p0 * s
        if BLOCK_M > 1:
            a1 += p1 * s
        if BLOCK_M > 2:
            a2 += p2 * s
            a3 += p3 * s
    else:
        a0 += p0
        if BLOCK_M > 1:
            a1 += p1
        if BLOCK_M > 2:
            a2 += p2
            a3 += p3
    return a0, a1, a2, a3


@triton.jit
def _gemv_rows(a0, a1, a2, a3, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row sums of the per-thread accumulators as ``[BLOCK_M, BLOCK_N]``, with the row offsets and mask."""
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = tl.where(offs_m[:, None] == 0, tl.sum(a0, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 1, tl.sum(a1, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 2, tl.sum(a2, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 3, tl.sum(a3, axis=1)[None, :], acc)
    return acc, offs_m, offs_m < M




# ----------------------------------------------------------------------------------------------
# MODE 4: streaming word GEMV (M <= 4): few channels per program, long K tiles, software-pipelined
# ----------------------------------------------------------------------------------------------
# Why a CUDA-core kernel: at M = 1 the tl.dot modes waste the tensor cores on one row. Each thread
# keeps a private accumulator per (row, word) it owns for the whole K loop; lanes are reduced once.
# (An earlier word GEMV over the stored byte order, 128 channels x one group per tile, had its
# 16-byte loads split into 4-byte ones by a per-word mask and measured 1.2-1.4x slower; removed.)
# MODE 4 is the layout of the bf16 skinny GEMV (ops.linear), which streams at the copy bandwidth:
# BLOCK_N channels (clamped into range, so full tiles need no mask) x BLOCK_KW words spanning many
# groups, 16-byte loads, the K loop pipelined by Triton (num_stages), per-word scales gathered from
# L1. Codes become floats without a convert or a subtract: the code goes into the top mantissa bits
# of 1.0, ``1 + q / 2**BITS`` (exact), and ``sum_k (q - z) x = 2**BITS * (sum_k v x - c sum_k x)``
# with ``c = 1 + z / 2**BITS`` is applied once per word; per code that is a shift, one mask-or and
# one FMA. The high half of each int4 word is shifted down once so every per-code shift is a left
# shift (which the compiler may issue on the FMA pipe). With PDL the first two tiles are loaded before
# the wait (``ops.pdl.GEMV_PREWAIT``) and decoded ahead of the loop. FP8 batch-1 step, with the bf16 GEMV
# and MODE 6 doing the same: none vs one tile 2.737 -> 2.607 ms, one vs two 2.622 -> 2.562 (two calls;
# results/h200/sweeps/probe_bs1_gemv_prewait_{peel,tiles}.json).


@triton.jit
def _gemv4_x(x_ptr, row, k, K, XMASK: tl.constexpr):
    """``x[row, k]`` as fp32 for code positions ``k [1, BLOCK_KW]`` (2-D, so the load lands in the
    weight tile's layout); XMASK: some ``k`` may be >= K (weights padded past K)."""
    if XMASK:
        f = tl.load(x_ptr + row + k, mask=k < K, other=0)
    else:
        f = tl.load(x_ptr + row + k)
    return f.to(tl.float32)


@triton.jit
def _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k, K, M, stride_xm, XMASK: tl.constexpr,
               XSUM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``p_r += v * x[r, k]`` for rows ``r < BLOCK_M`` (rows past M re-read row M - 1; the store masks
    them); XSUM: also ``x_r += x[r, k]`` (the per-word activation sums of the INT decode)."""
    xv = _gemv4_x(x_ptr, 0, k, K, XMASK)
    p0 += v * xv
    if XSUM:
        x0 += xv
    if BLOCK_M > 1:
        xv = _gemv4_x(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, XMASK)
        p1 += v * xv
        if XSUM:
            x1 += xv
    if BLOCK_M > 2:
        xv = _gemv4_x(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, XMASK)
        p2 += v * xv
        xv3 = _gemv4_x(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, XMASK)
        p3 += v * xv3
        if XSUM:
            x2 += xv
            x3 += xv3
    return p0, p1, p2, p3, x0, x1, x2, x3


@triton.jit
def _gemv4_add(a0, a1, a2, a3, p0, p1, p2, p3, x0, x1, x2, x3, c, s, BLOCK_M: tl.constexpr):
    """``a_r += (p_r - c * x_r) * s`` for the rows ``r < BLOCK_M``."""
    a0 += (p0 - c * x0) * s
    if BLOCK_M > 1:
        a1 += (p1 - c * x1) * s
    if BLOCK_M > 2:
        a2 += (p2 - c * x2) * s
        a3 += (p3 - c * x3) * s
    return a0, a1, a2, a3


@triton.jit
def _word_load(ptrs, kw, kw_end, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """Per-word values ``[BLOCK_N, BLOCK_KW]`` at ``ptrs``; unless EVEN, words at or past ``kw_end``
    read 0 (their codes, scales and zero points then contribute nothing)."""
    if EVEN:
        if EVICT:  # the weights, streamed once per call
            v = tl.load(ptrs, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs)
    else:
        if EVICT:
            v = tl.load(ptrs, mask=(kw < kw_end)[None, :], other=0, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs, mask=(kw < kw_end)[None, :], other=0)
    return v


# PACKED MODE 4 (INT4 and FP8, M <= 4): a thread's 4 consecutive words decoded into packed fp16 pairs and
# multiplied with packed FMAs into one fp16x2 sum per row, 16 (INT4) / 8 (FP8) products per lane; the lanes add
# in fp32. The activations are fp16 pairs scaled by a power of two per 4 words and row (``_x_pow2``).
#   INT4: one LOP3 per pair puts q under the exponent of 64 or of 4 (64 + q / 16, 4 + q / 16: exact; one shift
#         per word), one packed subtract of the same with z gives (q - z) / 16 exactly.
#   FP8 : the e4m3 byte's sign to bit 15 of a half, its other 7 bits to bits 7-13: the value times 2**-8, exact
#         (bytes 1 and 3 sit at the halves' tops already; bytes 0 and 2 are shifted there).
# One asm block decodes a word once for all rows.
_PK_WORDS = 4  # words per packed step: a thread's own, of one scale group


def _packed_asm(fp8: bool, rows: int) -> str:
    """The packed dot's PTX over a step's ``_PK_WORDS`` words and ``rows`` rows. Operands: ``$0 .. $(rows - 1)``
    the fp32 sums, then the words, then each row's fp16x2 activation pairs, word by word (INT4: pairs ``j = 0..3`` of
    codes ``j``, ``j + 4``; FP8: bytes 1 and 3, then bytes 0 and 2), then for INT4 the zero pairs of nibbles
    at bits 0-3 (``64 + z / 16``) and 4-7 (``4 + z / 16``) of each half. A nibble at bits 4-7 needs no shift:
    under the exponent of 4 its place value is already 1/16."""
    per, words = (2 if fp8 else 4), _PK_WORDS
    w0, x0 = rows, rows + words
    mz0, mz1 = f"${x0 + rows * words * per}", f"${x0 + rows * words * per + 1}"
    acc = ["a"] if rows == 1 else [f"a{r}" for r in range(rows)]
    lines = ["{", f".reg .b32 t, v, {', '.join(acc)}{', s' if fp8 else ''};", ".reg .b16 lo, hi;",
             ".reg .f32 flo, fhi;"]
    for i in range(words):
        w = f"${w0 + i}"
        if fp8:
            steps = [[f"shr.u32 t, {w}, 1;", f"and.b32 s, {w}, 0x80008000;"],
                     [f"shl.b32 t, {w}, 7;", f"shl.b32 s, {w}, 8;", "and.b32 s, s, 0x80008000;"]]
            steps = [pre + ["lop3.b32 v, t, 0x3F803F80, s, 0xEA;"] for pre in steps]
        else:
            steps = []
            for j in range(4):
                src, (mask, magic, mz) = (w if j < 2 else "t"), (("0x000F000F", "0x54005400", mz0) if j % 2 == 0
                                                                else ("0x00F000F0", "0x44004400", mz1))
                steps.append([f"lop3.b32 v, {src}, {mask}, {magic}, 0xEA;", f"sub.rn.f16x2 v, v, {mz};"])
            lines.append(f"shr.u32 t, {w}, 8;")
        for j, step in enumerate(steps):
            lines += step
            for r, a in enumerate(acc):
                x = f"${x0 + (r * words + i) * per + j}"
                lines.append(f"mul.rn.f16x2 {a}, v, {x};" if i == j == 0 else f"fma.rn.f16x2 {a}, v, {x}, {a};")
    for r, a in enumerate(acc):
        lines += [f"mov.b32 {{lo, hi}}, {a};", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;",
                  f"add.f32 ${r}, flo, fhi;"]
    lines.append("}")
    return "\n".join(lines)


_PK_I4_1 = tl.constexpr(_packed_asm(False, 1))
_PK_I4_2 = tl.constexpr(_packed_asm(False, 2))
_PK_I4_4 = tl.constexpr(_packed_asm(False, 4))
_PK_F8_1 = tl.constexpr(_packed_asm(True, 1))
_PK_F8_2 = tl.constexpr(_packed_asm(True, 2))
_PK_F8_4 = tl.constexpr(_packed_asm(True, 4))


def _packed_cons(fp8: bool, rows: int) -> str:
    """The asm's constraints: the fp32 sums, then the words, the pairs (16 / 8 a row), INT4's zero pairs."""
    return ",".join(["=f"] * rows + ["r"] * (_PK_WORDS * (1 + rows * (2 if fp8 else 4)) + (0 if fp8 else 2)))


_PKC_I4_1, _PKC_I4_2, _PKC_I4_4 = (tl.constexpr(_packed_cons(False, r)) for r in (1, 2, 4))
_PKC_F8_1, _PKC_F8_2, _PKC_F8_4 = (tl.constexpr(_packed_cons(True, r)) for r in (1, 2, 4))


@triton.jit
def _split4(t):
    """``t [R, C]`` -> 4 tensors ``[R, C / 4]``: elements ``4 i + p`` for ``p < 4`` (a thread's own words)."""
    e, o = tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 4, 2, 2]))
    a, c = tl.split(e)
    b, d = tl.split(o)
    return a, b, c, d


@triton.jit
def _absmax4(x):
    a, b, c, d = _split4(x)
    return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d)))


@triton.jit
def _pairs4(lo, hi, sc):
    """fp16x2 pairs ``(lo * sc, hi * sc)`` of each of the 4 word columns (``_split4``) of ``lo``, ``hi``."""
    l0, l1, l2, l3 = _split4(lo)
    h0, h1, h2, h3 = _split4(hi)
    return _f16x2(l0 * sc, h0 * sc), _f16x2(l1 * sc, h1 * sc), _f16x2(l2 * sc, h2 * sc), _f16x2(l3 * sc, h3 * sc)


@triton.jit
def _x_pow2(mx):
    """For the largest |x| ``mx`` of a 4-word step: the power of two bringing it into [2**10, 2**11) and its
    inverse (``2**(137 - e)`` for the biased exponent ``e >= 11``). fp16 then holds every x of the step to
    2**-24 of that max, and the products per lane stay below 2**15 (INT4: 16 of |q - z| / 16 < 1; FP8: 8 of
    |e4m3| * 2**-8 <= 1.75)."""
    e = tl.maximum((mx.to(tl.int32, bitcast=True) >> 23) & 0xFF, 11)
    return ((264 - e) << 23).to(tl.float32, bitcast=True), ((e - 10) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int4_row(x_ptr, row, k, K, ILV: tl.constexpr, XMASK: tl.constexpr):
    """A row's activations for INT4's packed step: 16 fp16x2 pairs (word-major) and the inverse scale."""
    xa = _gemv4_x(x_ptr, row, k, K, XMASK)
    xb = _gemv4_x(x_ptr, row, k + ILV, K, XMASK)
    xc = _gemv4_x(x_ptr, row, k + ILV * 2, K, XMASK)
    xd = _gemv4_x(x_ptr, row, k + ILV * 3, K, XMASK)
    xe = _gemv4_x(x_ptr, row, k + ILV * 4, K, XMASK)
    xf = _gemv4_x(x_ptr, row, k + ILV * 5, K, XMASK)
    xg = _gemv4_x(x_ptr, row, k + ILV * 6, K, XMASK)
    xh = _gemv4_x(x_ptr, row, k + ILV * 7, K, XMASK)
    sc, inv = _x_pow2(tl.maximum(tl.maximum(tl.maximum(_absmax4(xa), _absmax4(xb)),
                                            tl.maximum(_absmax4(xc), _absmax4(xd))),
                                 tl.maximum(tl.maximum(_absmax4(xe), _absmax4(xf)),
                                            tl.maximum(_absmax4(xg), _absmax4(xh)))))
    a0, a1, a2, a3 = _pairs4(xa, xe, sc)  # pair 0 (codes 0, 4) of words 0..3
    b0, b1, b2, b3 = _pairs4(xb, xf, sc)
    c0, c1, c2, c3 = _pairs4(xc, xg, sc)
    d0, d1, d2, d3 = _pairs4(xd, xh, sc)
    return a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3, inv


@triton.jit
def _fp8_row(x_ptr, row, k, K, ILV: tl.constexpr, XMASK: tl.constexpr):
    """A row's activations for FP8's packed step: 8 fp16x2 pairs (word-major: bytes 1 and 3, then 0 and 2)
    and the inverse scale."""
    x0 = _gemv4_x(x_ptr, row, k, K, XMASK)
    x1 = _gemv4_x(x_ptr, row, k + ILV, K, XMASK)
    x2 = _gemv4_x(x_ptr, row, k + ILV * 2, K, XMASK)
    x3 = _gemv4_x(x_ptr, row, k + ILV * 3, K, XMASK)
    sc, inv = _x_pow2(tl.maximum(tl.maximum(_absmax4(x0), _absmax4(x1)), tl.maximum(_absmax4(x2), _absmax4(x3))))
    b0, b1, b2, b3 = _pairs4(x1, x3, sc)
    a0, a1, a2, a3 = _pairs4(x0, x2, sc)
    return b0, a0, b1, a1, b2, a2, b3, a3, inv


@triton.jit
def _row_pairs(x_ptr, row, k, K, FP8: tl.constexpr, ILV: tl.constexpr, XMASK: tl.constexpr):
    """``_fp8_row`` or ``_int4_row``: the row's fp16x2 pairs, then the inverse scale."""
    if FP8:
        p = _fp8_row(x_ptr, row, k, K, ILV, XMASK)
    else:
        p = _int4_row(x_ptr, row, k, K, ILV, XMASK)
    return p


@triton.jit
def _packed_rows(w, x_ptr, k, K, M, stride_xm, s, mz, mz1, a0, a1, a2, a3, FP8: tl.constexpr, ILV: tl.constexpr,
                 XMASK: tl.constexpr, BLOCK_M: tl.constexpr):
    """``a_r += s * sum_k c_k x[r, k]`` over each 4 consecutive words of ``w [R, C]`` for rows ``r < BLOCK_M``
    (rows past M re-read row M - 1), in one ``_packed_asm`` block per step: INT4 (``c = (q - z) / 16``; int32
    words of 8 codes, nibble ``j`` at bits ``4 j``, one group; ``mz`` / ``mz1 [R, C / 4]`` the fp16x2 pairs of
    ``64 + z / 16`` / ``4 + z / 16``) or FP8 (``c = e4m3 * 2**-8``; words of 4 bytes; ``mz``, ``mz1`` unused).
    ``s [R, C / 4]`` the group / block scales (FP8 per-channel: 1)."""
    NP: tl.constexpr = 8 if FP8 else 16  # fp16x2 activation pairs per row and step
    ws = _split4(w)
    p = _row_pairs(x_ptr, 0, k, K, FP8, ILV, XMASK)
    ops = ws + p[:NP]
    if BLOCK_M > 1:
        q = _row_pairs(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        ops = ops + q[:NP]
    if BLOCK_M > 2:
        u = _row_pairs(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        v = _row_pairs(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, FP8, ILV, XMASK)
        ops = ops + u[:NP] + v[:NP]
    if not FP8:
        ops = ops + (mz, mz1)
    if BLOCK_M == 1:
        r0 = tl.inline_asm_elementwise(_PK_F8_1 if FP8 else _PK_I4_1, _PKC_F8_1 if FP8 else _PKC_I4_1, ops,
                                       dtype=tl.float32, is_pure=True, pack=1)
    elif BLOCK_M == 2:
        r0, r1 = tl.inline_asm_elementwise(_PK_F8_2 if FP8 else _PK_I4_2, _PKC_F8_2 if FP8 else _PKC_I4_2, ops,
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        a1 += r1 * (s * q[NP])
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(_PK_F8_4 if FP8 else _PK_I4_4, _PKC_F8_4 if FP8 else _PKC_I4_4, ops,
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
        a1 += r1 * (s * q[NP])
        a2 += r2 * (s * u[NP])
        a3 += r3 * (s * v[NP])
    a0 += r0 * (s * p[NP])
    return a0, a1, a2, a3


@triton.jit
def _f16x2(lo, hi):
    """fp32 ``lo``, ``hi`` as one fp16x2 register (int32; ``lo`` in the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _gemv4_tile(w, kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M, stride_xm, FP8: tl.constexpr,
                BITS: tl.constexpr, ILV: tl.constexpr, SCALE_WORDS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                HAS_ZEROS: tl.constexpr, EVEN: tl.constexpr, XMASK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PACKED: tl.constexpr = False):
    """One K tile of MODE 4: the loaded words ``w [BLOCK_N, BLOCK_KW]`` at word positions ``kw``, decoded
    and multiplied into the per-thread accumulators ``a_r`` (see ``_gemv4_kernel``). PACKED: ``_packed_rows`` in
    packed fp16 instead of one fp32 FMA per code and row."""
    CPW: tl.constexpr = 32 // BITS
    FIELD: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)  # the top BITS mantissa bits
    k = ((kw // ILV) * (ILV * CPW) + kw % ILV)[None, :]  # K position of each word's code 0
    p0, p1, p2, p3 = _gemv_zeros(BLOCK_N, BLOCK_KW)
    x0, x1, x2, x3 = _gemv_zeros(1, BLOCK_KW)
    if PACKED:  # a thread's 4 consecutive words share one scale group (SCALE_WORDS % 4 == 0)
        kwp = tl.max(tl.reshape(kw, [BLOCK_KW // 4, 4]), axis=1)
        g = (kwp // SCALE_WORDS)[None, :]
        if FP8:
            if SCALE_ROWS != 0:
                s = _word_load(s_rows + g, kwp, kw_end, EVEN, False).to(tl.float32)
            else:  # per-channel scales, after the K loop
                s = tl.full([1, BLOCK_KW // 4], 1.0, tl.float32)
            a0, a1, a2, a3 = _packed_rows(w, x_ptr, k, K, M, stride_xm, s, 0, 0, a0, a1, a2, a3, True, ILV, XMASK,
                                          BLOCK_M)
        else:
            s = _word_load(s_rows + g, kwp, kw_end, EVEN, False).to(tl.float32)
            if HAS_ZEROS:  # 64 + z / 16 and 4 + z / 16 in both halves (integer zero points 0..15)
                zi = _word_load(z_rows + g, kwp, kw_end, EVEN, False).to(tl.int32) * 65537
                mz = 0x54005400 | zi
                mz1 = 0x44004400 | (zi << 4)
            else:
                mz = tl.full([BLOCK_N, BLOCK_KW // 4], 0x54085408, tl.int32)
                mz1 = tl.full([BLOCK_N, BLOCK_KW // 4], 0x44804480, tl.int32)
            a0, a1, a2, a3 = _packed_rows(w, x_ptr, k, K, M, stride_xm, s, mz, mz1, a0, a1, a2, a3, False, ILV,
                                          XMASK, BLOCK_M)
    elif FP8:
        for j in tl.static_range(4):
            # byte j to the top, arithmetic shift by 4, mask: the fp32 pattern of e4m3 * 2**-120
            if j < 3:
                t = w << (24 - 8 * j)
            else:
                t = w
            v = ((t >> 4) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000
            p0, p1, p2, p3, x0, x1, x2, x3 = _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k + ILV * j,
                                                        K, M, stride_xm, XMASK, False, BLOCK_M)
        if SCALE_ROWS != 0:
            s = _word_load(s_rows + (kw // SCALE_WORDS)[None, :], kw, kw_end, EVEN, False)
            a0, a1, a2, a3 = _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, s, BLOCK_M, True)
        else:
            a0, a1, a2, a3 = _gemv_add(a0, a1, a2, a3, p0, p1, p2, p3, 1.0, BLOCK_M, False)
    else:
        w = w.to(tl.uint32, bitcast=True)
        hi = w >> 16
        for j in tl.static_range(CPW):
            # code j into the top mantissa bits of 1.0: v = 1 + q / 2**BITS exactly
            if BITS * j < 16:
                t = w << (23 - BITS - BITS * j)
            else:
                t = hi << (23 - BITS - (BITS * j - 16))
            v = ((t & FIELD) | 0x3F800000).to(tl.float32, bitcast=True)
            p0, p1, p2, p3, x0, x1, x2, x3 = _gemv4_fma(p0, p1, p2, p3, x0, x1, x2, x3, v, x_ptr, k + ILV * j,
                                                        K, M, stride_xm, XMASK, True, BLOCK_M)
        g = (kw // SCALE_WORDS)[None, :]
        s = _word_load(s_rows + g, kw, kw_end, EVEN, False).to(tl.float32)
        # sum_k (q - z) x = 2**BITS * (sum_k v x - c * sum_k x), c = 1 + z / 2**BITS (2**BITS after the loop)
        if HAS_ZEROS:
            c = 1.0 + _word_load(z_rows + g, kw, kw_end, EVEN, False).to(tl.float32) * (1.0 / (1 << BITS))
        else:
            c = 1.0 + (2 ** (BITS - 1)) / (1 << BITS)
        a0, a1, a2, a3 = _gemv4_add(a0, a1, a2, a3, p0, p1, p2, p3, x0, x1, x2, x3, c, s, BLOCK_M)
    return a0, a1, a2, a3


@triton.jit
def _gemv4_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, kw_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    FP8: tl.constexpr, BITS: tl.constexpr, ILV: tl.constexpr, SCALE_WORDS: tl.constexpr,
    SCALE_ROWS: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
    XMASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    ACT: tl.constexpr = 0, PREWAIT: tl.constexpr = 0, USE_PDL: tl.constexpr = False, PACKED: tl.constexpr = False,
    NSPLIT: tl.constexpr = 1,
):
    """MODE 4 GEMV, ``M <= 4``: ``qw`` int32 words ``[N, KW]`` in the interleaved layout of
    ``_ilv_words`` (word ``i`` of each block of ``ILV`` words holds codes ``i + ILV * j`` at bits
    ``BITS * j``), so code ``j`` of consecutive words is consecutive in K and x loads are vectors.

    INT (``FP8`` False): scales ``[N, *]`` (one per ``SCALE_WORDS`` words), zero points likewise or
    ``2**(BITS-1)``. FP8: e4m3 bytes; ``SCALE_ROWS`` 0: per-channel scales ``[N]`` applied after the
    K loop; else ``[cdiv(N, SCALE_ROWS), *]`` block scales, one per ``SCALE_WORDS`` words.
    Grid ``(cdiv(N, BLOCK_N), split)``; ``EVEN``: every split is whole tiles of ``BLOCK_KW`` words;
    ``XMASK``: the weights are padded past K.

    ``ACT`` (``ops.linear.triton.ACTIVATIONS``; no split-K): ``qw`` is a merged ``[gate; up]`` weight
    (``N = 2D``), a program streams gate row ``c`` and up row ``D + c`` side by side, and ``y [M, D]``
    gets ``act(gate) * up`` (the gated-MLP epilogue, as in ``ops.linear``'s GEMV).
    """
    pdl_release(USE_PDL)
    r = tl.arange(0, BLOCK_N)
    if ACT != 0:
        c_out = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        rows = tl.minimum(c_out, N // 2 - 1) + (r % 2) * (N // 2)
        offs_n = rows
        n_mask = c_out < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + r
        n_mask = offs_n < N
        rows = tl.minimum(offs_n, N - 1)  # clamped: full tiles need no mask
    kw_start = tl.program_id(1) * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    offs_kw = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_KW), BLOCK_KW), BLOCK_KW)
    w_rows = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn
    # PREWAIT (with PDL): the first 1 or 2 tiles' weights stream in while the previous kernel finishes.
    # A second tile past the split's end is read at the last whole tile instead (EVEN) or masked, and
    # never consumed.
    if PREWAIT >= 1:
        w_first = _word_load(w_rows + (kw_start + offs_kw)[None, :], kw_start + offs_kw, kw_end, EVEN, True)
    if PREWAIT >= 2:
        kw2 = kw_start + BLOCK_KW + offs_kw
        if EVEN:
            kw2 = tl.minimum(kw_start + BLOCK_KW, kw_end - BLOCK_KW) + offs_kw
        w_second = _word_load(w_rows + kw2[None, :], kw2, kw_end, EVEN, True)
    pdl_wait(USE_PDL)
    if FP8 and SCALE_ROWS != 0:
        s_rows = s_ptr + (rows // SCALE_ROWS).to(tl.int64)[:, None] * stride_sn
    else:
        s_rows = s_ptr + rows.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + rows.to(tl.int64)[:, None] * stride_sn
    a0, a1, a2, a3 = _gemv_zeros(BLOCK_N, BLOCK_KW // 4 if PACKED else BLOCK_KW)  # PACKED: one per 4 words
    kb0 = kw_start
    if PREWAIT >= 1:  # the tiles loaded before the wait are consumed here; the loop takes the rest
        a0, a1, a2, a3 = _gemv4_tile(w_first, kw_start + offs_kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M,
                                     stride_xm, FP8, BITS, ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN, XMASK,
                                     BLOCK_M, BLOCK_N, BLOCK_KW, PACKED)
        kb0 = kw_start + BLOCK_KW
    if PREWAIT >= 2:
        if kb0 < kw_end:
            a0, a1, a2, a3 = _gemv4_tile(w_second, kb0 + offs_kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K,
                                         M, stride_xm, FP8, BITS, ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN,
                                         XMASK, BLOCK_M, BLOCK_N, BLOCK_KW, PACKED)
        kb0 = kb0 + BLOCK_KW
    for kb in tl.range(kb0, kw_end, BLOCK_KW):
        kw = kb + offs_kw
        w = _word_load(w_rows + kw[None, :], kw, kw_end, EVEN, True)
        a0, a1, a2, a3 = _gemv4_tile(w, kw, kw_end, x_ptr, s_rows, z_rows, a0, a1, a2, a3, K, M, stride_xm, FP8, BITS,
                                     ILV, SCALE_WORDS, SCALE_ROWS, HAS_ZEROS, EVEN, XMASK, BLOCK_M, BLOCK_N, BLOCK_KW,
                                     PACKED)
    acc, offs_m, m_mask = _gemv_rows(a0, a1, a2, a3, M, BLOCK_M, BLOCK_N)
    if FP8:
        if SCALE_ROWS == 0:
            acc = acc * tl.load(s_ptr + rows)[None, :]
        if PACKED:
            acc = acc * 256.0  # the fp16 decode is e4m3 * 2**-8
        else:
            acc = acc * 1.329227995784916e36  # 2**120, exact
    else:
        acc = acc * (1 << BITS)
    if ACT != 0:
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        out = _act_mul(g, u, y_ptr, ACT)
        cols = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (cols < N // 2)[None, :])
    else:
        _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K, NSPLIT)


def _gemv_split(n_tiles: int, kw: int, bkw: int, device: torch.device, split: int) -> tuple[int, int]:
    """Split count and words per split: ~2 programs per SM unless ``split`` is given (> 0)."""
    if split <= 0:
        split = 1
        while split < 16 and n_tiles * split < 2 * _num_sms(device) and kw // (2 * split) >= 4 * bkw:
            split *= 2
    per = triton.cdiv(triton.cdiv(kw, split), bkw) * bkw
    return triton.cdiv(kw, per), per


# Codes per interleave block of the MODE 4 layout (a group smaller than this is its own block).
ILV_CODES = 128
# id(qweight) -> (weak reference to qweight, its MODE 4 words); entries leave with their qweight.
_ILV_CACHE: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def interleave_words(codes: torch.Tensor, bits: int, ilv_codes: int) -> torch.Tensor:
    """Codes ``[N, Kc]`` (ints ``< 2**bits``, ``Kc`` a multiple of ``ilv_codes``) -> int32 words
    ``[N, Kc * bits / 32]`` in the MODE 4 layout: within each block of ``ilv_codes`` codes, word ``i``
    holds codes ``i + (ilv_codes * bits / 32) * j`` at bits ``bits * j``."""
    if bits not in (4, 8):
        raise ValueError(f"bits: must be 4 or 8, got {bits!r}")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise TypeError(f"codes: expected a 2-D integer tensor, got {getattr(codes, 'shape', type(codes))}")
    cpw = 32 // bits
    n, kc = codes.shape
    if ilv_codes <= 0 or kc % ilv_codes or ilv_codes % cpw:
        raise ValueError(f"codes: {kc} columns do not split into blocks of {ilv_codes} codes of {bits} bits")
    c = codes.to(torch.int64).reshape(n, kc // ilv_codes, cpw, ilv_codes // cpw).transpose(2, 3)
    words = (c << (torch.arange(cpw, device=codes.device, dtype=torch.int64) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).reshape(n, -1).contiguous()


# The MODE 4 and MODE 6 repacks keep a second copy of each weight that runs them (0.5 B/param for INT4,
# 1 B/param for INT8/FP8). ``INFERCORE_WO_REPACK=0`` (or setting this False) trades that memory for speed:
# decode-sized calls then take the tensor-core paths (MODE 5, else MODE 2) on the stored layout.
REPACK = os.environ.get("INFERCORE_WO_REPACK", "1") != "0"


def _ilv_cached(qweight: torch.Tensor, make) -> torch.Tensor | None:
    """The MODE 4 words of ``qweight`` (made once, kept while ``qweight`` lives); None when repacking is
    off (:data:`REPACK`) and none exist, or while a CUDA graph is being captured and they were not made
    yet (the capture must not allocate them)."""
    key = id(qweight)
    hit = _ILV_CACHE.get(key)
    if hit is not None and hit[0]() is qweight:
        return hit[1]
    if not REPACK or (qweight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    words = make()
    _ILV_CACHE[key] = (weakref.ref(qweight), words)
    weakref.finalize(qweight, _ILV_CACHE.pop, key, None)
    return words


def _pad_codes(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -codes.shape[1] % multiple
    return torch.nn.functional.pad(codes, (0, pad)) if pad else codes


# MODE 4's packed fp16 dot (``_packed_rows``) where it can run: 16-bit activations, CUDA,
# not the interpreter (inline PTX), scale groups of whole 4-word steps. By default where the H200 measured it
# faster (PACKED_DEFAULT: kind, BLOCK_M); a config's "PACKED" overrides; ``INFERCORE_WO_PACKED=0`` turns the
# default off.
PACKED_DOT = os.environ.get("INFERCORE_WO_PACKED", "1") != "0"
PACKED_DEFAULT = {("int4", 1), ("int4", 2), ("fp8", 1), ("fp8", 2)}


def _packed_ok(x: torch.Tensor, meta: dict) -> bool:
    return ((meta["FP8"] or meta["BITS"] == 4) and meta["SCALE_WORDS"] % 4 == 0 and x.shape[0] <= GEMV_M_MAX
            and x.is_cuda and not _INTERPRET and x.dtype in (torch.bfloat16, torch.float16))


def _launch_gemv4(x: torch.Tensor, words: torch.Tensor, n: int, cfg: dict, s: torch.Tensor, z: torch.Tensor,
                  stride_sn: int, act: str | None = None, **meta) -> torch.Tensor:
    """Run the MODE 4 GEMV; ``cfg["BLOCK_K"]`` counts codes per tile. With ``act`` the gated
    epilogue (``[M, n // 2]``; one K split, BLOCK_N rounded up to even)."""
    m, k = x.shape
    kw = words.shape[1]
    cpw = 32 // meta["BITS"]
    bn = cfg["BLOCK_N"]
    bkw = max(4, cfg["BLOCK_K"] // cpw)
    if act is not None:  # a program owns bn // 2 gate/up row pairs, all of K
        bn += bn % 2
        tiles, n_out = triton.cdiv(n // 2, bn // 2), n // 2
        split, per = 1, triton.cdiv(kw, bkw) * bkw
    else:
        tiles, n_out = triton.cdiv(n, bn), n
        split, per = _gemv_split(tiles, kw, bkw, x.device, cfg.get("SPLIT", 0))
        cfg["SPLIT"] = split
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, tiles) if split > 1 else y
    even = kw % per == 0 and per % bkw == 0
    use_pdl = pdl_enabled(x)
    # (PACKED's per-thread step needs 4 consecutive words per thread and row: BLOCK_KW >= 128 x warps)
    block_m = triton.next_power_of_2(m)
    default = PACKED_DOT and ("fp8" if meta["FP8"] else "int4", block_m) in PACKED_DEFAULT
    packed = bool(cfg.get("PACKED", default)) and _packed_ok(x, meta) and bkw >= 128 * cfg["num_warps"]
    _gemv4_kernel[(tiles, split)](
        x, words, s, z, ws, y, cnt, m, n, k, kw, per, x.stride(0), words.stride(0), stride_sn, y.stride(0),
        SPLIT_K=split > 1, NSPLIT=split, EVEN=even, XMASK=(not even) or kw * cpw > k, BLOCK_M=block_m,
        BLOCK_N=bn, BLOCK_KW=bkw, ACT=ACTIVATIONS[act], PREWAIT=GEMV_PREWAIT if use_pdl else 0, PACKED=packed,
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **meta, **pdl_launch(use_pdl),
    )
    return y


# ----------------------------------------------------------------------------------------------
# MODE 5: tensor-core small-M kernel decoding stored int32 words two codes per instruction
# ----------------------------------------------------------------------------------------------
#
# The stored weights (INT4 bytes along K, or FP8 e4m3 bytes), read as int32 words, are turned into
# the dot operand with a few integer instructions per *pair* of codes: each 32-bit result holds two
# 16-bit float patterns, and that register is already what the MMA consumes (two K-adjacent
# operand elements), so the compiler emits no repacking. A word holds ``CPW`` codes (8 INT4, 4 FP8),
# ``k = CPW * i + p`` for code position ``p`` of word ``i``; pair ``j`` takes positions ``j`` (low half)
# and ``j + CPW / 2`` (high half):
#   INT4 : ((w >> 4j) & 0x000F000F) | MAGIC   -> MAGIC_BASE + q exactly (one shift, one LOP3;
#          bf16's 7-bit mantissa cannot hold a nibble left at bits 4-7, so every pair shifts)
#   FP8  : the e4m3 byte's sign to bit 15, its other 7 bits under the 16-bit float's exponent LSB
#          (value times 2**-120 in bf16, 2**-8 in fp16; the factor is folded into the scale)
# The activations are permuted to the same order (a register shuffle of a [16, BLOCK_K] tile), so
# the dot is a plain sum over K; INT4 zero points apply per step as ``z * sum(x)`` (no per-weight
# subtract). The main loop at the 128x128 tile is 3.1 (INT4) / 2.7 (FP8) instructions per code against
# 5.1 for MODE 4 and 6-9 for MODE 1/2 (benchmarks/sass_count.py, sm90); the tensor cores make
# M = 1..16 cost about the same. It is latency-bound nonetheless (docs/quantization.md, "Speed").


@triton.jit
def _pair_bits(w, J: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, MAGIC: tl.constexpr):
    """Pair ``J`` of every word in ``w`` (int32) as two 16-bit float bit patterns in one int32."""
    if FP8:
        if J == 0:  # bytes 0 and 2 move to the top of each half
            t = w << 8
        else:  # bytes 1 and 3 already are
            t = w
        if F16:  # fp16: 7 bits from bit 7 (the value times 2**-8)
            bits = (t & -2147450880) | ((t >> 1) & 0x3F803F80)  # -2147450880 == 0x80008000
        else:  # bf16: 7 bits from bit 4 (the value times 2**-120)
            bits = (t & -2147450880) | ((t >> 4) & 0x07F007F0)
    else:
        bits = ((w >> (4 * J)) & 0x000F000F) | (MAGIC * 65537)
    return bits


@triton.jit
def _unpair(bits, like):
    """int32 ``[R, C]`` of 16-bit pairs -> ``[R, 2C]`` in ``like``'s dtype (low half first)."""
    lo = bits.to(tl.int16).to(like.dtype, bitcast=True)
    hi = (bits >> 16).to(tl.int16).to(like.dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [bits.shape[0], bits.shape[1] * 2])


@triton.jit
def _x_pairs(a, NP: tl.constexpr, BLOCK_M: tl.constexpr, BKW: tl.constexpr):
    """``a [BLOCK_M, BKW * 2 * NP]`` -> NP tensors ``[BLOCK_M, 2 * BKW]``, the activations of each pair
    in the order ``_unpair`` gives (word-major, then low/high half). Returned as a tuple."""
    if NP == 2:
        x0, x1 = tl.split(tl.reshape(a, [BLOCK_M, BKW, 2, 2]))
        r = (tl.reshape(x0, [BLOCK_M, 2 * BKW]), tl.reshape(x1, [BLOCK_M, 2 * BKW]))
    else:
        e, o = tl.split(tl.reshape(a, [BLOCK_M, BKW, 2, 2, 2]))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        r = (tl.reshape(x0, [BLOCK_M, 2 * BKW]), tl.reshape(x1, [BLOCK_M, 2 * BKW]),
             tl.reshape(x2, [BLOCK_M, 2 * BKW]), tl.reshape(x3, [BLOCK_M, 2 * BKW]))
    return r


@triton.jit
def _words_small_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    FP8: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # FP8: 0 per channel, else the block edge; INT4: unused
    MAGIC: tl.constexpr, MAGIC_BASE: tl.constexpr, FOLD: tl.constexpr,
    MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
    NSPLIT: tl.constexpr = 1,
):
    """MODE 5 small-M weight-only (INT4 group-wise or emulated FP8) on tensor cores. Grid
    ``(cdiv(N, BLOCK_N), SPLIT)`` as in ``_wq_small_kernel``, but split-K partials are summed inside
    the kernel by the last program of each channel tile (``_gemv_finish``), so a call is one launch.
    MODE 1 / 2: orientation as in ``_tile_dot``. ``stride_qn`` and ``KW`` count int32 words;
    ``BLOCK_K`` (codes) stays inside one group / scale block. ``EVEN``: every tile is whole (N, K per
    split and K are multiples of the tile), so loads carry no channel / K masks. One dot per pair
    (stacking the pairs into one operand measured 1.2-2.2x slower on the H200,
    sweeps/sweep_quant_wo_mode5_one_dot.json: the permutation is not
    free in registers)."""
    CPW: tl.constexpr = 4 if FP8 else 8
    NP: tl.constexpr = CPW // 2
    BKW: tl.constexpr = BLOCK_K // CPW
    pdl_release(USE_PDL)
    offs_n, n_mask, offs_m, m_mask, rows_w, rows_x, acc = _small_setup(M, N, stride_xm, stride_qn, MODE,
                                                                       BLOCK_M, BLOCK_N)
    pdl_wait(USE_PDL)  # before x: the previous kernel writes it
    wp = qw_ptr.to(tl.pointer_type(tl.int32))
    pid_k = tl.program_id(1)
    kw_start = pid_k * (k_per_split // CPW)
    kw_end = tl.minimum(kw_start + k_per_split // CPW, KW)
    for kw0 in range(kw_start, kw_end, BKW):
        k0 = kw0 * CPW
        offs_w = kw0 + tl.arange(0, BKW)
        if EVEN:
            w = tl.load(wp + rows_w + offs_w[None, :], eviction_policy="evict_first")
            a = tl.load(x_ptr + rows_x + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
        else:
            w = tl.load(wp + rows_w + offs_w[None, :], mask=n_mask[:, None] & (offs_w[None, :] < KW), other=0,
                        eviction_policy="evict_first")
            a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        xs = _x_pairs(a, NP, BLOCK_M, BKW)
        part = _tile_dot(xs[0], _unpair(_pair_bits(w, 0, FP8, a.dtype == tl.float16, MAGIC), a), MODE,
                         DOT_PRECISION)
        for j in tl.static_range(1, NP):
            part = _tile_dot_acc(xs[j], _unpair(_pair_bits(w, j, FP8, a.dtype == tl.float16, MAGIC), a), part,
                                 MODE, DOT_PRECISION)
        if FP8:
            if SCALE_BLOCK != 0:
                sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask,
                             other=0.0)
                part = part * _chan(sb, MODE)
            acc += part
        else:
            s, z = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, stride_sn, k0 // GROUP, HAS_ZEROS, 4, BLOCK_N)
            asum = tl.sum(a.to(tl.float32), axis=1)
            acc += (part - _chan(z + MAGIC_BASE, MODE) * _row(asum, MODE)) * _chan(s, MODE)
    if FP8:
        if SCALE_BLOCK == 0:
            acc = acc * _chan(tl.load(s_ptr + offs_n, mask=n_mask, other=0.0), MODE)
        acc = acc * FOLD
    if MODE == 2:
        acc = tl.trans(acc)
    _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K, NSPLIT)


def _launch_words(x: torch.Tensor, qweight: torch.Tensor, s: torch.Tensor, z: torch.Tensor, n: int, kdim: int,
                  cfg: dict, **meta) -> torch.Tensor:
    """Run MODE 5 over ``kdim`` stored codes per row (``x`` has ``meta K`` columns): one launch,
    split-K finished in the kernel."""
    m, k = x.shape
    cpw = 4 if meta["FP8"] else 8
    bk = cfg["BLOCK_K"]
    kps = triton.cdiv(triton.cdiv(kdim, cfg["SPLIT"]), bk) * bk
    split = triton.cdiv(kdim, kps)
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = arrival_counters(x.device, tiles) if split > 1 else y
    even = n % cfg["BLOCK_N"] == 0 and k == kdim and kdim % kps == 0 and kps % bk == 0
    _words_small_kernel[(tiles, split)](
        x, qweight, s, z, ws, y, cnt, m, n, k, kdim // cpw, kps, x.stride(0), qweight.stride(0) // 4, s.stride(0),
        y.stride(0), MODE=2, DOT_PRECISION=_dot_precision(x.dtype), EVEN=even, SPLIT_K=split > 1, NSPLIT=split,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 1), **meta, **pdl_launch(pdl_enabled(x)),
    )
    return y


def _words_ok(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """MODE 5 needs 16-bit activations and rows of whole, 4-byte aligned int32 words."""
    return (x.dtype in (torch.bfloat16, torch.float16) and qweight.stride(0) % 4 == 0
            and qweight.shape[1] % 4 == 0 and qweight.data_ptr() % 16 == 0 and qweight.stride(1) == 1)


# ----------------------------------------------------------------------------------------------
# FP8 e4m3, emulated (integer decode + bf16/fp16 dot)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fp8_decode_kernel(q_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = _fp8_e4m3_bits_to_f32(tl.load(q_ptr + offs, mask=mask, other=0))
    tl.store(y_ptr + offs, v * 1.329227995784916e36, mask=mask)  # 2**120, exact


def fp8_decode_triton(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes ``uint8`` (any shape) -> fp32, through the emulated decode."""
    q = q.contiguous()
    y = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if q.numel():
        _fp8_decode_kernel[(triton.cdiv(q.numel(), 1024),)](q, y, q.numel(), BLOCK=1024)
    return y


@triton.jit
def _fp8_as_operand(b, DECODE: tl.constexpr):
    """e4m3 bytes -> the dot operand's own bit pattern, equal to the value times 1/FOLD: DECODE 0
    fp32 (x fp32), 1 bf16, 2 fp16. The same two shifts as the fp32 decode, landing in a 16-bit
    float when the activations are 16-bit, so no float conversion and no multiply per weight."""
    if DECODE == 0:
        w = _fp8_e4m3_bits_to_f32(b)
    else:
        x16 = b.to(tl.int16)
        if DECODE == 1:
            w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
        else:
            w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return w


@triton.jit
def _fp8_small_kernel(
    x_ptr, qw_ptr, s_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
    SCALE_BLOCK: tl.constexpr,  # 0: per output channel; else block edge (scales [N/B, K/B])
    DECODE: tl.constexpr, FOLD: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small-M emulated-FP8 weight-only; grid, split-K and MODE as in ``_wq_small_kernel``.

    Weights decode as in ``_fp8_wo_kernel`` (DECODE, FOLD). ``BLOCK_K`` divides ``SCALE_BLOCK``,
    so a block scale is one per channel per step.
    """
    offs_n, n_mask, offs_m, m_mask, rows_w, rows_x, acc = _small_setup(M, N, stride_xm, stride_qn, MODE,
                                                                       BLOCK_M, BLOCK_N)
    pid_k = tl.program_id(1)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        b = _small_w(qw_ptr, rows_w, n_mask, k0, K, BLOCK_K)
        a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        part = _tile_dot(a, _fp8_as_operand(b, DECODE), MODE, DOT_PRECISION)
        if SCALE_BLOCK != 0:
            sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask, other=0.0)
            part = part * _chan(sb, MODE)
        acc += part
    if SCALE_BLOCK == 0:
        acc = acc * _chan(tl.load(s_ptr + offs_n, mask=n_mask, other=0.0), MODE)
    acc = acc * FOLD
    _small_store(y_ptr + pid_k.to(tl.int64) * stride_ys, acc, offs_m, m_mask, offs_n, n_mask, stride_ym, MODE)


@triton.autotune(
    configs=_configs(
        [
            *_small_tile_cfgs(),
            _mm_cfg(64, 128, 128, 4, 4),
            _mm_cfg(128, 128, 128, 8, 3),
            _mm_cfg(128, 256, 64, 8, 3),
        ],
        _interp_cfg(),
    ),
    key=["M_BUCKET", "N", "K", "SCALE_BLOCK"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune_m(cfgs, {**nargs, **kw})},
)
@triton.jit
def _fp8_wo_kernel(
    x_ptr, qw_ptr, s_ptr, y_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_qn, stride_sn, stride_ym,
    SCALE_BLOCK: tl.constexpr,  # 0: per output channel; else block edge (scales [N/B, K/B])
    DECODE: tl.constexpr,  # 0: fp32 pattern (fp32 x); 1: bf16 pattern; 2: fp16 pattern
    FOLD: tl.constexpr,  # the decode's power-of-two offset: 2**120 (fp32/bf16) or 2**8 (fp16)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n, m_mask, n_mask, rows_x = _gemm_tile(M, N, stride_xm, BLOCK_M, BLOCK_N, GROUP_M)
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _x_tile(x_ptr, rows_x, m_mask, k0, K, BLOCK_K)
        b = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0)
        w = _fp8_as_operand(b, DECODE)  # scales apply after the dot
        if SCALE_BLOCK == 0:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:  # BLOCK_K divides SCALE_BLOCK: one block column per step
            sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask,
                         other=0.0)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * sb[None, :]
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * FOLD
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


def _prune_m(configs, nargs):
    m = nargs["M_BUCKET"]
    small = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    return small or configs[:1]


def fp8_wo_matmul_triton(
    x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None, *, config: dict | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times emulated-FP8 ``w`` (logical ``[N, K]``, e4m3 bytes) -> ``[M, N]``
    in ``x.dtype``.

    ``bias``: optional ``[N]``. ``config``: small-M launch override, ``act``: the gated epilogue, both
    as in :func:`wq_matmul_triton`.
    """
    _check_act(act, w.shape[0])
    if w.block_size is not None and w.block_size != FP8_BLOCK:
        raise ValueError(f"w: block scales must be {FP8_BLOCK}x{FP8_BLOCK}, got {w.block_size}")
    n, k = w.shape
    x = _check_x("fp8_wo_matmul_triton", x, k)
    m = x.shape[0]
    scale_block = 0 if w.block_size is None else w.block_size
    decode, fold = {torch.float32: (0, 2.0**120), torch.bfloat16: (1, 2.0**120),
                    torch.float16: (2, 2.0**8)}[x.dtype]
    fused = act if bias is None else None
    kmax = scale_block or max(triton.next_power_of_2(k), 64)  # the small-M tiles' largest K step
    y = _run_mode6("fp8", x, w, n, k, config, fused, TF.fp8_ok, TF.fp8_matmul)
    if y is not None:
        if fused is not None:
            return y
    elif _small_rows("fp8", x, w.qweight, kmax):
        cfg, words = _small_plan("fp8", x, w.qweight, n, k, kmax, config,
                                 lambda: interleave_words(_pad_codes(w.qweight, ILV_CODES), 8, ILV_CODES))
        if words is not None and cfg["MODE"] == 4:
            y = _launch_gemv4(x, words, n, cfg, w.scales, w.scales, w.scales.stride(0), fused, FP8=True, BITS=8,
                              ILV=ILV_CODES // 4, SCALE_WORDS=max(scale_block, ILV_CODES) // 4,
                              SCALE_ROWS=scale_block, HAS_ZEROS=False)
            if fused is not None:
                return y
        elif cfg["MODE"] == 5:
            y = _launch_words(x, w.qweight, w.scales, w.scales, n, k, cfg, FP8=True, GROUP=1, HAS_ZEROS=False,
                              SCALE_BLOCK=scale_block, MAGIC=0, MAGIC_BASE=0.0, FOLD=fold)
        else:
            y = _launch_small(_fp8_small_kernel, x, w.qweight, (w.scales,), (k,), n, k, cfg,
                              SCALE_BLOCK=scale_block, DECODE=decode, FOLD=fold)
    elif use_dequant(x, "fp8"):
        y = F.linear(x, dequant_fp8_triton(w, x.dtype))
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _fp8_wo_kernel[grid](
            x, w.qweight, w.scales, y, m, n, k, _m_bucket(m),
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), y.stride(0),
            SCALE_BLOCK=scale_block, DECODE=decode, FOLD=fold, DOT_PRECISION=_dot_precision(x.dtype),
        )
    return _apply_act(y if bias is None else y + bias.to(y.dtype), act)


# ----------------------------------------------------------------------------------------------
# GGUF Q4_0 / Q4_1 / Q8_0 blocks as stored
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_f16(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.autotune(
    configs=_configs(
        [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "NBLK": 4, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "NBLK": 4, "GROUP_M": 8}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "NBLK": 2, "GROUP_M": 8}, num_warps=4, num_stages=3),
        ],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "NBLK": 2, "GROUP_M": 2}, num_warps=4),
    ),
    key=["M_BUCKET", "N", "K", "QTYPE"],
    prune_configs_by={"early_config_prune": lambda cfgs, nargs, **kw: _prune_m(cfgs, {**nargs, **kw})},
)
@triton.jit
def _gguf_kernel(
    x_ptr, raw_ptr, y_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_rn, stride_ym,
    QTYPE: tl.constexpr, BB: tl.constexpr, HDR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NBLK: tl.constexpr, GROUP_M: tl.constexpr,
):
    BLOCK_K: tl.constexpr = NBLK * 32
    offs_m, offs_n, m_mask, n_mask, rows_x = _gemm_tile(M, N, stride_xm, BLOCK_M, BLOCK_N, GROUP_M)
    i = tl.arange(0, 32)[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nb = K // 32
    for b0 in range(0, nb, NBLK):
        offs_blk = b0 + tl.arange(0, NBLK)
        bmask = (n_mask[:, None] & (offs_blk[None, :] < nb))[:, :, None]  # [BN, NBLK, 1]
        base = raw_ptr + offs_n.to(tl.int64)[:, None, None] * stride_rn + offs_blk[None, :, None] * BB
        d = _load_f16(base, bmask)
        if QTYPE == 2:  # Q8_0
            q = tl.load(base + 2 + i, mask=bmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = q * d
        else:
            byte = tl.load(base + HDR + (i % 16), mask=bmask, other=0)
            q = ((byte >> ((i // 16) * 4).to(tl.uint8)) & 15).to(tl.float32)
            if QTYPE == 1:
                w = q * d + _load_f16(base + 2, bmask)
            else:
                w = (q - 8.0) * d
        a = _x_tile(x_ptr, rows_x, m_mask, b0 * 32, K, BLOCK_K)
        wk = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(a.dtype)
        acc = tl.dot(a, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    _store_tile(y_ptr, acc, offs_m, m_mask, offs_n, n_mask, stride_ym)


def gguf_matmul_triton(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times GGUF raw blocks ``w`` (logical ``[N, K]``; ``raw`` uint8
    ``[N, K / 32 * block bytes]``) -> ``[M, N]`` in ``x.dtype``; ``bias``: optional ``[N]``."""
    n, k = w.shape
    x = _check_x("gguf_matmul_triton", x, k)
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _gguf_kernel[grid](
        x, w.raw, y, m, n, k, _m_bucket(m), x.stride(0), w.raw.stride(0), y.stride(0),
        QTYPE=_GGUF_QTYPE[w.qtype], BB=BLOCK_BYTES[w.qtype], HDR=4 if w.qtype == "q4_1" else 2,
        DOT_PRECISION=_dot_precision(x.dtype),
    )
    return y if bias is None else y + bias.to(y.dtype)
