"""Tile building blocks of the Triton weight-only kernels, and the kernels built from tiles alone.

* ``_wq_small_kernel`` -- INT4/INT8 group-wise weights, M <= 16, MODE 1/2. One program owns
  ``BLOCK_N`` output channels and one K slice (split-K when the channel tiles alone cannot keep
  ~4 programs per SM in flight; fp32 partials then land in a workspace ``_finish_splits`` sums). Each
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
  bytes), dequantized in registers, then ``tl.dot`` (``gguf_matmul_triton``).

The decode-sized kernels over int32 words live beside this file: MODE 4 in ``wo_gemv`` (its packed
fp16 dot in ``wo_packed``), MODE 5 in ``wo_words``; ``triton_wo`` picks among all of them.
Autotuning runs on GPUs only; under ``TRITON_INTERPRET=1`` (CPU tests) each kernel has one config.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..devices import capability
from .formats import GGUFWeight
from .gguf import BLOCK_BYTES
from .triton_dequant import _fp8_e4m3_bits_to_f32

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


def _check_x(fn: str, x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as a 2-D fp32/fp16/bf16 ``[M, k]`` tensor with unit stride along K (copied if not)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _MAGIC:
        raise TypeError(f"{fn}: x must be a fp32/fp16/bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{fn}: x must be [M, {k}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


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
    ``[N, K / 32 * block bytes]``) -> ``[M, N]`` in ``x.dtype``; ``bias``: optional ``[N]``. Q4_0 / Q4_1 / Q8_0 only:
    the formats loaded from files alone (Q5_*, K-quants) take the reference (the weight dequantized at each call)."""
    if w.qtype not in _GGUF_QTYPE:
        from .naive import gguf_matmul_ref

        return gguf_matmul_ref(x, w, bias)
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
