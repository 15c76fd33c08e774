"""Triton weight-only GEMV/GEMM kernels with the dequantization fused into the load.

* ``_wq_small_kernel`` -- INT4/INT8 group-wise weights, M <= 16 (decode). One program owns
  ``BLOCK_N`` output channels and one K slice (split-K when the channel tiles alone cannot keep
  ~4 programs per SM in flight; fp32 partials then land in a workspace the wrapper sums). Each
  weight tile is loaded once (16-byte loads along K) and serves all M rows: FMAs for M = 1, or a
  ``tl.dot`` with the rows padded to 16 (``x @ w^T`` or the swapped ``w @ x^T``). Per K step of
  constant scale it forms ``sum_k q[n,k] x[k]`` and applies ``s * (. - z * sum_k x[k])``, so the
  zero point costs one multiply per group, not per weight. 4-bit codes are not interleaved back
  into K order; the even and odd activations are multiplied separately instead.
* ``_wq_gemm_kernel`` -- the same weights, larger M: codes -> ``(q - z) * s`` in the activation
  dtype -> ``tl.dot``.
* ``_fp8_small_kernel`` -- the same small-M structure for the emulated FP8 weights below.
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

import torch
import triton
import triton.language as tl

from .formats import FP8_BLOCK, FP8Weight, GGUFWeight, IntWeight
from .gguf import BLOCK_BYTES

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# INFERCORE_QUANT_AUTOTUNE=0 keeps only the first GPU config of each kernel (fast test runs).
_AUTOTUNE = os.environ.get("INFERCORE_QUANT_AUTOTUNE", "1") != "0"


def _mm_cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages)
_GGUF_QTYPE = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
# Up to this many rows the small-M (decode) kernels run; above, the tiled GEMMs.
SMALL_M_MAX = 16
# Up to this many rows MODE 3 (the CUDA-core GEMV over int32 words) can run.
GEMV_M_MAX = 4


def _configs(gpu: list[triton.Config], interp: triton.Config) -> list[triton.Config]:
    if _INTERPRET:
        return [interp]
    return gpu if _AUTOTUNE else gpu[:1]


def _m_bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), 256)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
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
    """Small-M (decode) INT4/INT8 weight-only; every loaded weight tile serves all M rows.

    Grid ``(cdiv(N, BLOCK_N), SPLIT)``: program ``(n, s)`` owns ``BLOCK_N`` channels and the K range
    ``[s * k_per_split, (s+1) * k_per_split)``; with ``SPLIT > 1`` it writes fp32 partials to slice
    ``s`` of ``y`` (stride ``stride_ys``). ``BLOCK_K <= GROUP``, so one scale/zero per channel
    per step, applied to the step's partial sums, never per weight.

    MODE 0: CUDA-core FMAs on fp32 codes (``BLOCK_M`` rows unrolled over one decoded tile).
    MODE 1: ``tl.dot(x, w^T)`` with the rows padded to ``BLOCK_M >= 16``.
    MODE 2: ``tl.dot(w, x^T)`` ("swap AB"): the decoded weights are the register-resident A operand,
    the tiny activation tile is B, so the wide ``BLOCK_N`` fills the MMA's M dimension.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # MODE 2's accumulator
    # Byte offsets (not k // 2) so alignment analysis can prove 16-byte loads along K.
    kb_start = pid_k * (k_per_split // PACK)
    kb_end = tl.minimum(kb_start + k_per_split // PACK, KP // PACK)
    for kb0 in range(kb_start, kb_end, BLOCK_K // PACK):
        k0 = kb0 * PACK
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 2 ** (BITS - 1), dtype=tl.float32)
        offs_b = kb0 + tl.arange(0, BLOCK_K // PACK)
        # Weights are read once per call: evict them first so x and the scales stay cached.
        b = tl.load(qw_ptr + rows_w + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < KP // PACK),
                    other=0, eviction_policy="evict_first")
        if BITS == 4:
            # Even and odd K go to separate products, so nibbles never need interleaving.
            if MODE == 0:  # one row: two strided loads (L1 hits) beat reshuffling a loaded tile
                ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                ae = tl.load(x_ptr + rows_x + ke[None, :], mask=m_mask[:, None] & (ke[None, :] < K), other=0.0)
                ao = tl.load(x_ptr + rows_x + ke[None, :] + 1, mask=m_mask[:, None] & (ke[None, :] + 1 < K),
                             other=0.0)
            else:  # 16 rows: vector loads, then split (the dot converts layouts anyway)
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K),
                            other=0.0)
                ae, ao = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
            if MODE == 0:
                # Nibble OR-ed into the mantissa of 2**23 is 2**23 + code exactly (no I2F).
                lo = ((b.to(tl.int32) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                hi = ((b.to(tl.int32) >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                part = tl.sum(lo[None, :, :] * ae.to(tl.float32)[:, None, :]
                              + hi[None, :, :] * ao.to(tl.float32)[:, None, :], axis=2)
                zb = z
            else:
                if MAGIC == 0:  # fp32 activations: exact small integers, converted
                    lo = (b & 15).to(tl.float32)
                    hi = (b >> 4).to(tl.float32)
                    zb = z
                else:  # 16-bit activations: MAGIC_BASE + code, no convert instruction
                    lo = ((b.to(tl.int16) & 15) | MAGIC).to(ae.dtype, bitcast=True)
                    hi = ((b.to(tl.int16) >> 4) | MAGIC).to(ae.dtype, bitcast=True)
                    zb = z + MAGIC_BASE
                if MODE == 1:
                    part = tl.dot(ae, tl.trans(lo), input_precision=DOT_PRECISION)
                    part = tl.dot(ao, tl.trans(hi), part, input_precision=DOT_PRECISION)
                else:  # [BLOCK_N, BLOCK_M]: stays in the MMA's orientation until the store
                    part = tl.dot(lo, tl.trans(ae), input_precision=DOT_PRECISION)
                    part = tl.dot(hi, tl.trans(ao), part, input_precision=DOT_PRECISION)
            asum = tl.sum(ae.to(tl.float32), axis=1) + tl.sum(ao.to(tl.float32), axis=1)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
            if MODE == 0:
                q = (b.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                part = tl.sum(q[None, :, :] * a.to(tl.float32)[:, None, :], axis=2)
            else:
                q = b.to(tl.float32).to(a.dtype)  # codes <= 255: exact in bf16/fp16
                if MODE == 1:
                    part = tl.dot(a, tl.trans(q), input_precision=DOT_PRECISION)
                else:
                    part = tl.dot(q, tl.trans(a), input_precision=DOT_PRECISION)
            zb = z
            asum = tl.sum(a.to(tl.float32), axis=1)
        # sum_k (q - z) x = sum_k q x - z sum_k x: the zero point costs one FMA per step, not per weight.
        if MODE == 2:
            acc_t += (part - zb[:, None] * asum[None, :]) * s[:, None]
        else:
            acc += (part - asum[:, None] * zb[None, :]) * s[None, :]
    if MODE == 2:
        acc = tl.trans(acc_t)
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.autotune(
    configs=_configs(
        [
            _mm_cfg(16, 64, 128, 4, 4),
            _mm_cfg(16, 32, 128, 4, 4),
            _mm_cfg(16, 128, 128, 4, 4),
            _mm_cfg(64, 128, 64, 4, 4),
            _mm_cfg(128, 128, 64, 8, 4),
            _mm_cfg(128, 256, 64, 8, 3),
        ],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4),
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
    pid_m, pid_n = _swizzle(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    for kb0 in range(0, KP // PACK, BLOCK_K // PACK):  # byte offsets: provably aligned loads
        k0 = kb0 * PACK
        g = k0 // GROUP  # BLOCK_K <= GROUP: one scale per channel per step
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 2 ** (BITS - 1), dtype=tl.float32)
        if BITS == 4:
            # Even and odd K in two dots, so nibbles never need interleaving. Each nibble becomes
            # MAGIC_BASE + code by OR-ing it into the mantissa of MAGIC_BASE (exact, no convert
            # instruction); the dot of the activations with MAGIC_BASE + z is subtracted after.
            offs_b = kb0 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(qw_ptr + rows_w + offs_b[None, :],
                        mask=n_mask[:, None] & (offs_b[None, :] < KP // 2), other=0)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K),
                        other=0.0)
            ae, ao = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
            if MAGIC == 0:  # fp32 activations: a 2**23 offset would swamp fp32 products; convert
                lo = (b & 15).to(tl.float32)
                hi = (b >> 4).to(tl.float32)
            else:
                lo = ((b.to(tl.int16) & 15) | MAGIC).to(ae.dtype, bitcast=True)
                hi = ((b.to(tl.int16) >> 4) | MAGIC).to(ae.dtype, bitcast=True)
            part = tl.dot(ae, tl.trans(lo), input_precision=DOT_PRECISION)
            part = tl.dot(ao, tl.trans(hi), part, input_precision=DOT_PRECISION)
            asum = tl.sum(ae.to(tl.float32), axis=1) + tl.sum(ao.to(tl.float32), axis=1)
            part -= asum[:, None] * (z + MAGIC_BASE)[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K),
                        other=0.0)
            q = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_mask[:, None] & (offs_k[None, :] < KP),
                        other=0)
            w = (q.to(tl.float32) - z[:, None]).to(a.dtype)  # |q - z| <= 255: exact in bf16/fp16
            part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
        acc += part * s[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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


def wq_matmul_triton(
    x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None, *, config: dict | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times INT4/INT8 ``w`` -> ``[M, N]`` in ``x.dtype``.

    ``config`` (M <= ``SMALL_M_MAX`` only; benchmarks/sweeps): the small-M launch parameters
    ``{"MODE", "BLOCK_N", "BLOCK_K", "SPLIT", "num_warps", "num_stages"}`` instead of the tuned
    table / heuristic.
    """
    if w.group_size & (w.group_size - 1) and w.scales.shape[1] != 1:
        raise ValueError(f"w: Triton kernels need a power-of-two group size, got {w.group_size}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    kp = w.padded_in_features
    group = _kernel_group(w)
    zeros = w.zeros if w.zeros is not None else w.scales
    if m <= SMALL_M_MAX:
        cfg = _small_cfg(f"int{w.bits}", n, kp, m, group, x.device, config)
        words = _as_words(w.qweight) if cfg["MODE"] == 3 and m <= GEMV_M_MAX else None
        if words is not None:
            y = _launch_gemv(_wq_gemv_kernel, x, words, n, cfg, (w.scales, zeros), w.scales.stride(0),
                             group * w.bits // 32, bits_per_code=w.bits, BITS=w.bits, GROUP=group,
                             HAS_ZEROS=w.zeros is not None)
            return y if bias is None else y + bias.to(y.dtype)
        if cfg["MODE"] == 3:  # rows not word-aligned, or too many rows: the tensor-core path
            cfg = _small_cfg(f"int{w.bits}", n, kp, m, group, x.device, {**cfg, "MODE": 2, "SPLIT": 0})
        ws, split, kps = _small_out(x, m, n, kp, cfg)
        _wq_small_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x, w.qweight, w.scales, zeros, ws, m, n, k, kp, kps,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), ws.stride(1), ws.stride(0),
            BITS=w.bits, GROUP=group, HAS_ZEROS=w.zeros is not None, MODE=cfg["MODE"],
            MAGIC=_MAGIC[x.dtype][0], MAGIC_BASE=_MAGIC[x.dtype][1], DOT_PRECISION=_dot_precision(x.dtype),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
        )
        y = _finish_splits(ws, x.dtype)
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _wq_gemm_kernel[grid](
            x, w.qweight, w.scales, zeros, y, m, n, k, kp, _m_bucket(m),
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), y.stride(0),
            BITS=w.bits, GROUP=group, HAS_ZEROS=w.zeros is not None, DOT_PRECISION=_dot_precision(x.dtype),
            MAGIC=_MAGIC[x.dtype][0], MAGIC_BASE=_MAGIC[x.dtype][1],
        )
    return y if bias is None else y + bias.to(y.dtype)


# Small-M launch table: (kind, N, K, M bucket) -> config, from benchmarks/sweep_quant_wo.py on an
# H200 (its "table" output). Missing entries use the heuristic in ``_small_cfg``.
SMALL_M_TUNED: dict[tuple[str, int, int, int], dict] = {
    ("int4", 14336, 4096, 1): {'MODE': 3, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 2, 'SPLIT': 8},
    ("int4", 14336, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 14336, 4096, 16): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 14336, 4096, 1): {'MODE': 3, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 4, 'SPLIT': 4},
    ("fp8", 14336, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 14336, 4096, 16): {'MODE': 1, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 6144, 4096, 1): {'MODE': 3, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 2, 'SPLIT': 8},
    ("int4", 6144, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 6144, 4096, 16): {'MODE': 2, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 6144, 4096, 1): {'MODE': 3, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 4, 'SPLIT': 4},
    ("fp8", 6144, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 6144, 4096, 16): {'MODE': 1, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 4096, 4096, 1): {'MODE': 3, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 2, 'SPLIT': 8},
    ("int4", 4096, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("int4", 4096, 4096, 16): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 4096, 4096, 1): {'MODE': 3, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 4, 'SPLIT': 4},
    ("fp8", 4096, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
    ("fp8", 4096, 4096, 16): {'MODE': 1, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 28672, 4096, 1): {'MODE': 3, 'BLOCK_N': 256, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 2, 'SPLIT': 8},
    ("int4", 28672, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("int4", 28672, 4096, 16): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 28672, 4096, 1): {'MODE': 3, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 4, 'SPLIT': 4},
    ("fp8", 28672, 4096, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 2},
    ("fp8", 28672, 4096, 16): {'MODE': 1, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 1},
    ("int4", 4096, 14336, 1): {'MODE': 3, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 2, 'SPLIT': 0},
    ("int4", 4096, 14336, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("int4", 4096, 14336, 16): {'MODE': 2, 'BLOCK_N': 128, 'BLOCK_K': 128, 'num_warps': 8, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 1): {'MODE': 3, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 1, 'UNROLL': 4, 'SPLIT': 0},
    ("fp8", 4096, 14336, 4): {'MODE': 2, 'BLOCK_N': 64, 'BLOCK_K': 128, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 8},
    ("fp8", 4096, 14336, 16): {'MODE': 1, 'BLOCK_N': 32, 'BLOCK_K': 256, 'num_warps': 4, 'num_stages': 3, 'SPLIT': 4},
}


def _small_cfg(kind: str, n: int, kp: int, m: int, kmax: int, device: torch.device,
               override: dict | None) -> dict:
    """Launch parameters of the small-M kernels; ``kmax`` caps BLOCK_K (group / scale block).

    Keys: MODE (0 FMA tile, 1 dot, 2 swapped dot, 3 word GEMV for M <= GEMV_M_MAX), BLOCK_N,
    BLOCK_K (codes per tile; MODE 3 tiles stay inside one group), UNROLL (MODE 3: tiles loaded per
    K step), SPLIT (0: heuristic), num_warps, num_stages.
    """
    mb = triton.next_power_of_2(m)
    if override is not None:
        cfg = dict(override)
    elif _INTERPRET:
        cfg = {"MODE": 3 if m <= GEMV_M_MAX else 2, "BLOCK_N": 16, "BLOCK_K": 64, "UNROLL": 2, "SPLIT": 0,
               "num_warps": 4, "num_stages": 1}
    elif any((kind, n, kp, b) in SMALL_M_TUNED for b in (mb, 2 * mb, 4 * mb, 8 * mb, 16 * mb)):
        # A bucket not swept borrows the next larger one (the same tile serves fewer rows).
        b = next(b for b in (mb, 2 * mb, 4 * mb, 8 * mb, 16 * mb) if (kind, n, kp, b) in SMALL_M_TUNED)
        cfg = dict(SMALL_M_TUNED[(kind, n, kp, b)])
        if cfg["MODE"] == 3 and m > GEMV_M_MAX:
            cfg = {"MODE": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}
    elif m == 1:
        # (Untuned M = 2..4 measured ~40x slower in the word GEMV than in the swapped dot on the H200.)
        # Word GEMV: 128 channels x one group's words per tile (4 rows of 16 B per thread), 4 tiles
        # in flight per step; split-K (reduced in the kernel) brings the programs to ~2 per SM.
        cfg = {"MODE": 3, "BLOCK_N": 128, "BLOCK_K": 128 if kind == "int4" else 64, "UNROLL": 4, "SPLIT": 0,
               "num_warps": 4, "num_stages": 1}
    else:
        cfg = {"MODE": 2, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 0, "num_warps": 4, "num_stages": 3}
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], kmax)
    cfg["BLOCK_M"] = mb if cfg["MODE"] in (0, 3) else max(16, mb)
    if cfg["MODE"] == 3:
        cfg.setdefault("UNROLL", 1)
        cfg.setdefault("SPLIT", 0)  # 0: chosen at launch (_gemv_split)
    elif not cfg.get("SPLIT"):
        # Split K until programs cover the multiprocessors ~4 times, keeping >= 4 steps per split.
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        split = 1
        while split < 16 and tiles * split < 4 * _num_sms(device) and kp // (2 * split) >= 4 * cfg["BLOCK_K"]:
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


# ----------------------------------------------------------------------------------------------
# MODE 3: CUDA-core GEMV over 32-bit words (M <= 4), bandwidth-bound decode path
# ----------------------------------------------------------------------------------------------
# Why a separate kernel: at M = 1 the tl.dot modes waste the tensor cores on one row and the
# reduction across lanes every K step costs more than the dequantization. Here each thread keeps
# a private accumulator per (row, word) it owns for the whole K loop and the lanes are reduced
# once at the end. The stored byte layout is read as little-endian int32 words, which for INT4 is
# GPTQ's word order (code k = 8i + j at bits 4j), so no repack is needed and every load is 16 B.


@triton.jit
def _gemv_x(x_ptr, row, k, K, XPAIRS: tl.constexpr, HIGH: tl.constexpr):
    """Activations ``x[row, k]`` for code positions ``k [BLOCK_KW]`` as fp32 ``[1, BLOCK_KW]``.

    XPAIRS: x is bf16 passed as int32 pairs (``row`` in pairs); the bf16 -> fp32 widening is then
    a shift (even ``k``) or a mask (odd ``k``, HIGH), no convert instruction.
    """
    if XPAIRS:
        v = tl.load(x_ptr + row + k // 2, mask=k < K, other=0)
        if HIGH:
            f = (v & -65536).to(tl.float32, bitcast=True)
        else:
            f = (v << 16).to(tl.float32, bitcast=True)
    else:
        f = tl.load(x_ptr + row + k, mask=k < K, other=0).to(tl.float32)
    return f[None, :]


@triton.jit
def _gemv_rows(acc, a0, a1, a2, a3, offs_m):
    """Row sums of the per-thread accumulators, assembled into ``[BLOCK_M, BLOCK_N]``."""
    acc = tl.where(offs_m[:, None] == 0, tl.sum(a0, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 1, tl.sum(a1, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 2, tl.sum(a2, axis=1)[None, :], acc)
    acc = tl.where(offs_m[:, None] == 3, tl.sum(a3, axis=1)[None, :], acc)
    return acc


@triton.jit
def _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N,
                 SPLIT_K: tl.constexpr):
    """Store ``acc [BLOCK_M, BLOCK_N]``; with split-K the last program of a column tile to arrive
    sums the fp32 partials (no second launch: at decode a launch costs as much as the GEMV)."""
    pid_n = tl.program_id(0)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K:
        pid_k = tl.program_id(1)
        nsplit = tl.num_programs(1)
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == nsplit - 1:
            tot = tl.zeros_like(acc)
            for s in range(0, nsplit):
                tot += tl.load(ws_ptr + s * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (graph replays too)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wq_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, kw_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, XPAIRS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """INT4/INT8 GEMV, ``M <= 4``: ``qw`` int32 words ``[N, KW]`` (``32 / BITS`` codes each; code
    ``j`` of word ``i`` is ``k = (32 / BITS) * i + j`` at bits ``BITS * j``).

    Grid ``(cdiv(N, BLOCK_N), split)``. Each K step loads UNROLL tiles of ``[BLOCK_N, BLOCK_KW]``
    words (several 16-byte loads in flight per thread); a tile lies in one group
    (``BLOCK_KW * 32 / BITS <= GROUP``), so its scale is one per channel. Per code: shift,
    mask-or into the mantissa of 2**23 (exact ``2**23 + q``), subtract ``2**23 + z`` (exact
    ``q - z``: the zero point costs nothing), one FMA per row into a per-thread accumulator. Per
    word and row: one FMA with the scale. Lanes are reduced once, after the K loop.
    """
    CPW: tl.constexpr = 32 // BITS
    CMASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_i = tl.arange(0, BLOCK_KW)
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    a0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    kw_start = pid_k * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    for kw0 in range(kw_start, kw_end, BLOCK_KW * UNROLL):
        for u in tl.static_range(UNROLL):
            kb = kw0 + u * BLOCK_KW
            kw = kb + offs_i
            w = tl.load(qw_ptr + rows_w + kw[None, :], mask=n_mask[:, None] & (kw < kw_end)[None, :], other=0,
                        eviction_policy="evict_first")
            g = (kb * CPW) // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)[:, None]
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.int32)
                zm = (z | 0x4B000000).to(tl.float32, bitcast=True)[:, None]
            else:
                zm = 8388608.0 + 2 ** (BITS - 1)
            p0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            for j in tl.static_range(CPW):
                q = ((((w >> (BITS * j)) & CMASK) | 0x4B000000).to(tl.float32, bitcast=True) - zm)
                k = kw * CPW + j
                p0 += q * _gemv_x(x_ptr, 0, k, K, XPAIRS, j % 2)
                if BLOCK_M > 1:
                    p1 += q * _gemv_x(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
                if BLOCK_M > 2:
                    p2 += q * _gemv_x(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
                    p3 += q * _gemv_x(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
            a0 += p0 * s
            if BLOCK_M > 1:
                a1 += p1 * s
            if BLOCK_M > 2:
                a2 += p2 * s
                a3 += p3 * s
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = _gemv_rows(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a0, a1, a2, a3, offs_m)
    _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, ws_ptr, y_ptr, cnt_ptr,
    M, N, K, KW, kw_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym,
    SCALE_BLOCK: tl.constexpr, XPAIRS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, UNROLL: tl.constexpr,
):
    """Emulated-FP8 GEMV, ``M <= 4``, over int32 words of 4 e4m3 bytes (``k = 4i + j`` in byte ``j``).

    Byte ``j`` is shifted to the top of the word (none for ``j = 3``); an arithmetic shift by 4
    then puts its sign at bit 31 and its 7 exponent/mantissa bits at bits 20..26, and one mask
    leaves exactly the fp32 pattern of ``e4m3 * 2**-120`` (subnormals included): <= 3 integer ops
    and one FMA per weight. ``2**120`` and the scale are applied per word and row (128x128 block
    scales; ``4 * BLOCK_KW`` divides the block) or once at the end (per channel).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_i = tl.arange(0, BLOCK_KW)
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    a0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
    kw_start = pid_k * kw_per_split
    kw_end = tl.minimum(kw_start + kw_per_split, KW)
    for kw0 in range(kw_start, kw_end, BLOCK_KW * UNROLL):
        for u in tl.static_range(UNROLL):
            kb = kw0 + u * BLOCK_KW
            kw = kb + offs_i
            w = tl.load(qw_ptr + rows_w + kw[None, :], mask=n_mask[:, None] & (kw < kw_end)[None, :], other=0,
                        eviction_policy="evict_first")
            p0 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p1 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p2 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            p3 = tl.zeros([BLOCK_N, BLOCK_KW], dtype=tl.float32)
            for j in tl.static_range(4):
                if j < 3:
                    t = w << (24 - 8 * j)
                else:
                    t = w
                wf = ((t >> 4) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000
                k = kw * 4 + j
                p0 += wf * _gemv_x(x_ptr, 0, k, K, XPAIRS, j % 2)
                if BLOCK_M > 1:
                    p1 += wf * _gemv_x(x_ptr, tl.minimum(1, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
                if BLOCK_M > 2:
                    p2 += wf * _gemv_x(x_ptr, tl.minimum(2, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
                    p3 += wf * _gemv_x(x_ptr, tl.minimum(3, M - 1) * stride_xm, k, K, XPAIRS, j % 2)
            if SCALE_BLOCK != 0:
                sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + (kb * 4) // SCALE_BLOCK, mask=n_mask,
                             other=0.0)[:, None]
                a0 += p0 * sb
                if BLOCK_M > 1:
                    a1 += p1 * sb
                if BLOCK_M > 2:
                    a2 += p2 * sb
                    a3 += p3 * sb
            else:
                a0 += p0
                if BLOCK_M > 1:
                    a1 += p1
                if BLOCK_M > 2:
                    a2 += p2
                    a3 += p3
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = _gemv_rows(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a0, a1, a2, a3, offs_m)
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * 1.329227995784916e36  # 2**120, exact
    _gemv_finish(acc, ws_ptr, y_ptr, cnt_ptr, offs_m, m_mask, offs_n, n_mask, stride_ym, M, N, SPLIT_K)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the in-kernel split-K reduction (reset by the kernel).

    One buffer per device: launches on one stream are ordered, so they may share it. Allocate
    before CUDA-graph capture (the first decode call does) so the graph does not own it.
    """
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """uint8 ``[N, B]`` -> int32 ``[N, B / 4]`` view, or None when rows are not 4-byte aligned."""
    if t.shape[1] % 4 or t.stride(1) != 1 or t.stride(0) % 4 or t.data_ptr() % 16:
        return None
    return t.view(torch.int32)


def _gemv_x_arg(x: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """bf16 rows of even length are passed as int32 pairs (the widening is then one ALU op)."""
    if x.dtype == torch.bfloat16 and x.shape[1] % 2 == 0 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0:
        return x.view(torch.int32), x.stride(0) // 2, True
    return x, x.stride(0), False


def _gemv_split(n_tiles: int, kw: int, bkw: int, device: torch.device, split: int) -> tuple[int, int]:
    """Split count and words per split: ~2 programs per SM unless ``split`` is given (> 0)."""
    if split <= 0:
        split = 1
        while split < 16 and n_tiles * split < 2 * _num_sms(device) and kw // (2 * split) >= 4 * bkw:
            split *= 2
    per = triton.cdiv(triton.cdiv(kw, split), bkw) * bkw
    return triton.cdiv(kw, per), per


def _launch_gemv(kernel, x: torch.Tensor, words: torch.Tensor, n: int, cfg: dict, tensors: tuple,
                 stride_sn: int, bkw_max: int, **meta) -> torch.Tensor:
    """Run a MODE 3 GEMV kernel; ``cfg["BLOCK_K"]`` counts codes, ``bkw_max`` caps the words per tile."""
    m, k = x.shape
    kw = words.shape[1]
    cpw = 32 // meta.pop("bits_per_code")
    bn = cfg["BLOCK_N"]
    bkw = max(1, min(cfg["BLOCK_K"] // cpw, bkw_max))
    unroll = cfg.get("UNROLL", 1)
    tiles = triton.cdiv(n, bn)
    split, per = _gemv_split(tiles, kw, bkw * unroll, x.device, cfg.get("SPLIT", 0))
    cfg["SPLIT"] = split
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = _counters(x.device, tiles) if split > 1 else y
    xa, sxm, pairs = _gemv_x_arg(x)
    kernel[(tiles, split)](
        xa, words, *tensors, ws, y, cnt, m, n, k, kw, per, sxm, words.stride(0), stride_sn, y.stride(0),
        XPAIRS=pairs, SPLIT_K=split > 1, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_KW=bkw,
        UNROLL=unroll, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1), **meta,
    )
    return y


# ----------------------------------------------------------------------------------------------
# FP8 e4m3, emulated (integer decode + bf16/fp16 dot)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fp8_e4m3_bits_to_f32(b):
    """uint8 e4m3 -> fp32 equal to the e4m3 value times 2**-120 (two shifts, no FP8 instruction)."""
    x = b.to(tl.int32)
    bits = ((x & 0x80) << 24) | ((x & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True)


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
def _fp8_small_kernel(
    x_ptr, qw_ptr, s_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
    SCALE_BLOCK: tl.constexpr,  # 0: per output channel; else block edge (scales [N/B, K/B])
    DECODE: tl.constexpr, FOLD: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small-M emulated-FP8 weight-only; grid, split-K and MODE as in ``_wq_small_kernel``.

    MODE 0 decodes to the fp32 pattern and uses FMAs; MODEs 1/2 decode to the activation dtype's
    own pattern (DECODE, as in ``_fp8_wo_kernel``) and use ``tl.dot``. ``BLOCK_K`` divides
    ``SCALE_BLOCK``, so a block scale is one per channel per step.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # MODE 2's accumulator
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        b = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0,
                    eviction_policy="evict_first")
        a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if MODE == 0:
            w = _fp8_e4m3_bits_to_f32(b)
            part = tl.sum(w[None, :, :] * a.to(tl.float32)[:, None, :], axis=2)
        else:
            if DECODE == 0:
                w = _fp8_e4m3_bits_to_f32(b)
            else:
                x16 = b.to(tl.int16)
                if DECODE == 1:
                    w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
                else:
                    w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
            if MODE == 1:
                part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
            else:  # [BLOCK_N, BLOCK_M]: stays in the MMA's orientation until the end
                part = tl.dot(w, tl.trans(a), input_precision=DOT_PRECISION)
        if SCALE_BLOCK != 0:
            sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask, other=0.0)
            part = part * (sb[:, None] if MODE == 2 else sb[None, :])
        if MODE == 2:
            acc_t += part
        else:
            acc += part
    if MODE == 2:
        acc = tl.trans(acc_t)
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * FOLD
    y_ptrs = y_ptr + pid_k.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.autotune(
    configs=_configs(
        [
            _mm_cfg(16, 64, 128, 4, 4),
            _mm_cfg(16, 32, 128, 4, 4),
            _mm_cfg(16, 128, 128, 4, 4),
            _mm_cfg(64, 128, 128, 4, 4),
            _mm_cfg(128, 128, 128, 8, 3),
            _mm_cfg(128, 256, 64, 8, 3),
        ],
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4),
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
    pid_m, pid_n = _swizzle(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    rows_w = offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(qw_ptr + rows_w + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        # The e4m3 byte becomes the operand's own bit pattern (value times 1/FOLD): the same two
        # shifts as the fp32 decode, landing in a 16-bit float when the activations are 16-bit,
        # so there is no float conversion and no multiply per weight. Scales apply after the dot.
        if DECODE == 0:
            w = _fp8_e4m3_bits_to_f32(b)
        else:
            x16 = b.to(tl.int16)
            if DECODE == 1:
                w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
            else:
                w = (((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
        if SCALE_BLOCK == 0:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:  # BLOCK_K divides SCALE_BLOCK: one block column per step
            sb = tl.load(s_ptr + (offs_n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_mask,
                         other=0.0)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * sb[None, :]
    if SCALE_BLOCK == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * FOLD
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _prune_m(configs, nargs):
    m = nargs["M_BUCKET"]
    small = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    return small or configs[:1]


def fp8_wo_matmul_triton(
    x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None, *, config: dict | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) times emulated-FP8 ``w`` -> ``[M, N]`` in ``x.dtype``.

    ``config``: small-M launch override, as in :func:`wq_matmul_triton`.
    """
    if w.block_size is not None and w.block_size != FP8_BLOCK:
        raise ValueError(f"w: block scales must be {FP8_BLOCK}x{FP8_BLOCK}, got {w.block_size}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    scale_block = 0 if w.block_size is None else w.block_size
    decode, fold = {torch.float32: (0, 2.0**120), torch.bfloat16: (1, 2.0**120),
                    torch.float16: (2, 2.0**8)}[x.dtype]
    if m <= SMALL_M_MAX:
        kmax = scale_block or max(triton.next_power_of_2(k), 64)
        cfg = _small_cfg("fp8", n, k, m, kmax, x.device, config)
        words = _as_words(w.qweight) if cfg["MODE"] == 3 and m <= GEMV_M_MAX else None
        if words is not None:
            y = _launch_gemv(_fp8_gemv_kernel, x, words, n, cfg, (w.scales,), w.scales.stride(0),
                             (scale_block or 1 << 30) // 4, bits_per_code=8, SCALE_BLOCK=scale_block)
            return y if bias is None else y + bias.to(y.dtype)
        if cfg["MODE"] == 3:
            cfg = _small_cfg("fp8", n, k, m, kmax, x.device, {**cfg, "MODE": 2, "SPLIT": 0})
        if cfg["MODE"] == 0:
            decode, fold = 0, 2.0**120  # FMAs run on the fp32 pattern whatever x is
        ws, split, kps = _small_out(x, m, n, k, cfg)
        _fp8_small_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
            x, w.qweight, w.scales, ws, m, n, k, kps,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), ws.stride(1), ws.stride(0),
            SCALE_BLOCK=scale_block, DECODE=decode, FOLD=fold, MODE=cfg["MODE"],
            DOT_PRECISION=_dot_precision(x.dtype),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
        )
        y = _finish_splits(ws, x.dtype)
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _fp8_wo_kernel[grid](
            x, w.qweight, w.scales, y, m, n, k, _m_bucket(m),
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), y.stride(0),
            SCALE_BLOCK=scale_block, DECODE=decode, FOLD=fold, DOT_PRECISION=_dot_precision(x.dtype),
        )
    return y if bias is None else y + bias.to(y.dtype)


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
    pid_m, pid_n = _swizzle(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
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
        offs_k = b0 * 32 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        wk = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(a.dtype)
        acc = tl.dot(a, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_matmul_triton(x: torch.Tensor, w: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` times GGUF raw blocks ``w`` -> ``[M, N]`` in ``x.dtype``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _gguf_kernel[grid](
        x, w.raw, y, m, n, k, _m_bucket(m), x.stride(0), w.raw.stride(0), y.stride(0),
        QTYPE=_GGUF_QTYPE[w.qtype], BB=BLOCK_BYTES[w.qtype], HDR=4 if w.qtype == "q4_1" else 2,
        DOT_PRECISION=_dot_precision(x.dtype),
    )
    return y if bias is None else y + bias.to(y.dtype)
