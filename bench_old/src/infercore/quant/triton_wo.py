"""Triton weight-only matmuls: the entry points (``wq_matmul_triton``, ``fp8_wo_matmul_triton``,
``gguf_matmul_triton``, ``fp8_decode_triton``) and the dispatch among their kernels.

Which kernel runs a call, by rows M (tables in ``wo_tables``, measured on the H200):

* 2-16 rows (``MODE9_RULES``: by kind and bytes of codes; INT4 from 3 rows) on sm90+: MODE 9, the CUDA stream-K
  kernel (``cuda_mma``, NVRTC-compiled, programmatic dependent launch);
* M <= 16 (decode): the fragment kernels where tuned (MODE 6 ``triton_frag``, MODE 7 ``gluon_frag`` on
  sm90+), else MODE 4, the CUDA-core word GEMV at M <= ``GEMV_M_MAX`` (``wo_gemv``, packed fp16 dot in
  ``wo_packed``), else MODE 5, tensor cores over the stored words (``wo_words``), else the MODE 1/2 dot
  tiles (``wo_tiles``);
* up to ``WORDS_M_MAX`` rows MODE 5 still runs where it can;
* more rows: the weight decoded once and multiplied by cuBLAS (``triton_dequant``), or the tiled GEMM
  with the dequant fused into the load (``wo_tiles``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from ..devices import capability
from ..ops.activation import GATED_ACTS, gated_act_and_mul
from . import cuda_mma as CM
from . import triton_frag as TF
from . import wo_gemv as G
from .formats import FP8_BLOCK, FP8Weight, IntWeight
from .triton_dequant import dequant_fp8_triton, dequant_int_triton, use_dequant
from .wo_gemv import GEMV_M_MAX, ILV_CODES, _ilv_cached, _launch_gemv4, _pad_codes, interleave_words
from .wo_tables import (
    _MODE2_DEFAULT,
    _MODE5_DEFAULT,
    MODE6_MIN_BYTES,
    MODE6_MIN_N,
    MODE6_TUNED,
    MODE7_TUNED,
    SMALL_M_TUNED,
    _tuned,
)
from .wo_tiles import (
    _INTERPRET,
    _MAGIC,
    _check_x,
    _dot_precision,
    _finish_splits,
    _fp8_small_kernel,
    _fp8_wo_kernel,
    _m_bucket,
    _num_sms,
    _wq_gemm_kernel,
    _wq_small_kernel,
    fp8_decode_triton,
    gguf_matmul_triton,
)
from .wo_words import _launch_words, _words_ok

__all__ = ["wq_matmul_triton", "fp8_wo_matmul_triton", "gguf_matmul_triton", "fp8_decode_triton",
           "interleave_words", "GEMV_M_MAX", "SMALL_M_MAX", "WORDS_M_MAX"]


# Up to this many rows the small-M (decode) kernels run; above, the tiled GEMMs.
SMALL_M_MAX = 16

# ... and up to this many the tensor-core words kernel (MODE 5) still runs where it can (INT4 / FP8 weights,
# 16-bit activations): its time barely grows with the rows, while the tiled GEMM took 2-3x bf16's time
# at 32-64 rows (results/h200/quant_wo_mid_m.json).
WORDS_M_MAX = 64


def _kernel_group(w: IntWeight) -> int:
    # Per-channel (one group spanning K): any power of two >= Kp keeps every sub-block inside it.
    if w.scales.shape[1] == 1:
        return max(triton.next_power_of_2(w.padded_in_features), 64)
    return w.group_size


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
    y = _run_mode9(x, w, config)
    if y is not None:
        return _apply_act(y if bias is None else y + bias.to(y.dtype), act)
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


# MODE 9 (``cuda_mma``) by default on sm90+, with its programmatic dependent launch (measured on the H200 against
# the Triton kernels in the same run, results/h200/sweeps/probe_mma_dispatch_poll.json, twenty-fifth session): per
# kind, the row range it takes by bytes of codes, ``(bytes_lo, bytes_hi, m_lo, m_hi)`` with bytes_lo <= bytes <
# bytes_hi. The Triton kernels stay faster at 1 row (both kinds), at 2 INT4 rows on 14336x4096 and 4096x4096 (MODE 9
# wins there on 6144x4096 and 4096x14336: left to Triton, the margins are small) and on the merged gate_up
# 28672x4096 INT4 below 8 rows. Its repack is one more copy of the codes, made on the first call.
MODE9_RULES = {
    "int4": ((0, 48 << 20, 3, 16), (48 << 20, 1 << 62, 8, 16)),
    "fp8": ((0, 1 << 62, 2, 16),),
}


# MODE 9 unit layouts other than ``cuda_mma.LAYOUT`` per weight shape: ``(n, k, warps, mt, whole_blocks)``. With
# ``whole_blocks`` each CTA takes whole channel blocks over the whole K (one per CTA where they fit in one wave: no
# partial exchange). Empty: no layout measured faster than the default at 14336x4096 (docs/quantization.md, "MODE 9,
# twenty-eighth and twenty-ninth sessions"). One layout per shape, so a weight keeps one MODE 9 repack whatever the
# row count.
MODE9_LAYOUTS: dict[str, tuple] = {"int4": (), "fp8": ()}


def mode9_layout(kind: str, n: int, k: int) -> tuple[int | None, int | None, bool]:
    """``(warps, mt, whole_blocks)`` of MODE 9 for an ``[n, k]`` weight of ``kind``: a ``MODE9_LAYOUTS`` entry, else
    the default layout under the stream-K grid."""
    for nn, kk, warps, mt, whole in MODE9_LAYOUTS[kind]:
        if (nn, kk) == (n, k):
            return warps, mt, whole
    return None, None, False


def mode9_rows(kind: str, nbytes: int) -> tuple[int, int]:
    """The rows ``(m_lo, m_hi)`` MODE 9 takes by default for a weight of ``nbytes`` bytes of codes."""
    for lo, hi, m_lo, m_hi in MODE9_RULES[kind]:
        if lo <= nbytes < hi:
            return m_lo, m_hi
    return 0, -1


def _mode9_kind(w) -> str:
    return "fp8" if isinstance(w, FP8Weight) else "int4"


def _mode9_ok(kind: str, x: torch.Tensor, w) -> bool:
    """Whether MODE 9 can run this call at all."""
    ok = CM.int4_ok(w) and x.shape[1] == w.padded_in_features if kind == "int4" else CM.fp8_ok(w)
    return ok and CM.available(x) and G.REPACK


def mode9_default(x: torch.Tensor, w: IntWeight | FP8Weight) -> bool:
    """Whether the dispatcher sends this call (``x [M, K]``, an INT4 / FP8 weight) to MODE 9 when no config is
    given (the kernel compiles here)."""
    if not isinstance(w, (IntWeight, FP8Weight)):
        return False
    kind = _mode9_kind(w)
    m_lo, m_hi = mode9_rows(kind, w.qweight.numel() * w.qweight.element_size())
    if not (_mode9_ok(kind, x, w) and m_lo <= x.shape[0] <= m_hi and capability(x.device).at_least(9)):
        return False
    warps, mt, _ = mode9_layout(kind, w.shape[0], x.shape[1])
    return CM.compiles(kind, x.dtype, x.device, x.shape[0] > 8, warps, mt)


def _run_mode9(x: torch.Tensor, w, config: dict | None) -> torch.Tensor | None:
    """MODE 9's ``[M, N]`` product when it takes this call (by default, or ``config={"MODE": 9}``), else None."""
    kind = _mode9_kind(w)
    forced = config is not None and config.get("MODE") == 9
    if not (mode9_default(x, w) if config is None else forced):
        return None
    if not _mode9_ok(kind, x, w):
        raise ValueError("config: MODE 9 needs CUDA sm80+ with NVRTC, bf16/fp16 activations of 1-16 rows, and INT4 "
                         "weights with K % 128 == 0 (unpadded) and groups of a multiple of 128 or FP8 weights with "
                         "K % 128 == 0 and per-channel or 128x128 block scales, and repacking on")
    n, k = w.shape[0], x.shape[1]
    warps, mt, whole = mode9_layout(kind, n, k)
    p = TF.packed(w.qweight, ("mode9", warps, mt),
                  lambda: CM.repack_int4(w, warps, mt) if kind == "int4" else CM.repack_fp8(w, warps))
    if p is None:
        if forced:
            raise ValueError("config: MODE 9's weight repack is made on the first eager call; run one before "
                             "capturing a CUDA graph")
        return None
    grid = None
    if whole:
        blocks = -(-n // CM.block_n(kind, warps, mt))
        grid = blocks if blocks <= torch.cuda.get_device_properties(x.device).multi_processor_count else None
    return CM.matmul(x, kind, p[0], p[1], n, k, warps=warps, mt=mt, grid=grid)


def _apply_act(y: torch.Tensor, act: str | None) -> torch.Tensor:
    """The gated activation of a merged ``[gate; up]`` product (the unfused path)."""
    return y if act is None else gated_act_and_mul(y, act)


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
    if m > SMALL_M_MAX or _INTERPRET or not x.is_cuda or not G.REPACK:  # MODE 6 repacks like MODE 4
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
    y = _run_mode9(x, w, config)
    if y is not None:
        return _apply_act(y if bias is None else y + bias.to(y.dtype), act)
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
