"""Host CPU kernels in C (``cpu_experts.c``), built at first use with the system C compiler and called through
ctypes: the routed experts of a MoE layer in one call over their plain bf16 weights.

Built with ``-O3 -march=native -fopenmp`` into a cache directory (``$INFERCORE_CACHE``, else
``~/.cache/infercore``), keyed by the source, the compiler and the host's CPU flags; the build takes about a
second. The OpenMP runtime is torch's own (``libgomp.so.1``, already loaded), so the kernels share torch's
threads. :func:`available` is False where no compiler, no OpenMP or ``INFERCORE_NATIVE_CPU=0``; callers then
keep their ATen / oneDNN paths. :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("cpu_experts.c")
_SRCS = (_SRC, Path(__file__).parent.parent / "cpu_kernels.c")  # one library: the MoE / GEMV kernels, the layer ops
_HEADER = Path(__file__).parent.parent / "cpu_bf16.h"  # included by both
_lib = None
_error: str | None = None
_tried = False
_lock = threading.Lock()
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DT = {torch.float32: 0, torch.bfloat16: 1}  # the dtype codes the kernels take


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc / cc) on PATH")
    srcs = (_SRC, *_SRCS[1:])
    src = b"".join(p.read_bytes() for p in (*srcs, _HEADER))
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(src + " ".join(flags).encode() + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("INFERCORE_CACHE") or Path.home() / ".cache" / "infercore")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise OSError(f"{cache} is not writable")
    except OSError:  # a read-only home: a private temporary directory
        cache = Path(tempfile.gettempdir()) / f"infercore-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"cpu_experts_{key}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            cmd = [cc, *flags, *map(str, srcs), "-o", tmp, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(tmp, lib)  # atomic: concurrent builders agree
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    dll.infercore_moe_experts_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P,
                                               _P, _INT]
    dll.infercore_moe_experts_bf16.restype = None
    dll.infercore_linear_bf16.argtypes = [_P, _I64, _I64, _P, _I64, _P, _INT]
    dll.infercore_linear_bf16.restype = None
    dll.infercore_moe_experts_q4.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P,
                                             _P, _P, _P, _INT]
    dll.infercore_moe_experts_q4.restype = None
    dll.infercore_moe_experts_q8.argtypes = dll.infercore_moe_experts_q4.argtypes
    dll.infercore_moe_experts_q8.restype = None
    dll.infercore_linear_q4.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _INT]
    dll.infercore_linear_q4.restype = None
    dll.infercore_linear_q8.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _INT]
    dll.infercore_linear_q8.restype = None
    dll.infercore_linear_q5.argtypes = dll.infercore_linear_q4.argtypes
    dll.infercore_linear_q5.restype = None
    dll.infercore_dequant_rows.argtypes = [_P, _P, _I64, _I64, _INT, _I64, _I64, _P, _INT]
    dll.infercore_dequant_rows.restype = None
    dll.infercore_linear_f32.argtypes = [_P, _I64, _I64, _P, _I64, _P, _INT]
    dll.infercore_linear_f32.restype = None
    dll.infercore_linear_fp8.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _INT]
    dll.infercore_linear_fp8.restype = None
    dll.infercore_dequant_fp8_rows.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, _INT]
    dll.infercore_dequant_fp8_rows.restype = None
    dll.infercore_dequant_lut4_rows.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _INT]
    dll.infercore_dequant_lut4_rows.restype = None
    dll.infercore_linear_lut4.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _INT]
    dll.infercore_linear_lut4.restype = _INT
    dll.infercore_native_isa.restype = _INT
    dll.infercore_set_a8.argtypes = [_INT]
    dll.infercore_set_a8.restype = _INT
    dll.infercore_a8_active.restype = _INT
    dll.infercore_set_attn_simd.argtypes = [_INT]
    dll.infercore_set_attn_simd.restype = _INT
    dll.infercore_attn_splits.argtypes = [_I64, _I64, _I64, _I64, _I64, _INT]
    dll.infercore_attn_splits.restype = _I64
    dll.infercore_read_pass.argtypes = [_P, _I64, _INT]
    dll.infercore_read_pass.restype = ctypes.c_uint64
    _F = ctypes.c_float
    dll.infercore_rms_norm.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _F, _F, _INT, _INT, _INT]
    dll.infercore_silu_and_mul.argtypes = [_P, _P, _I64, _I64, _INT, _INT]
    dll.infercore_lora_apply.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT,
                                         _INT]
    dll.infercore_rope_write_kv.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                            _I64, _I64, _I64, _INT, _P, _P, _INT, _INT]
    dll.infercore_att_codes_ok.argtypes = [_I64, _I64]
    dll.infercore_att_codes_ok.restype = _INT
    dll.infercore_decode_attention.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                               _F, _I64, _P, _INT, _P, _P, _INT, _INT]
    dll.infercore_llama_decode_layer.argtypes = [_P, _P, _P, _P, _I64, _I64, _P, _F, _P, _I64, _I64, _I64, _P, _P,
                                                 _I64, _P, _P, _I64, _I64, _P, _P, _P, _I64, _I64, _F, _I64, _P, _F,
                                                 _I64, _INT, _P, _P, _INT, _P, _P, _F, _P, _INT, _P, _P]
    dll.infercore_llama_decode_layer.restype = _INT
    dll.infercore_llama_decode_layers.argtypes = [_I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P,
                                                  _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _F, _I64, _INT, _INT, _P,
                                                  _P]
    dll.infercore_llama_decode_layers.restype = _INT
    for f in ("rms_norm", "silu_and_mul"):
        getattr(dll, f"infercore_{f}").restype = None
    dll.infercore_rope_write_kv.restype = _INT
    dll.infercore_decode_attention.restype = _INT
    return dll


def _load():
    if _tried:
        return _lib
    with _lock:
        return _load_locked()


def _load_locked():
    global _lib, _error, _tried
    if not _tried:
        _tried = True
        if os.environ.get("INFERCORE_NATIVE_CPU", "1") == "0":
            _error = "disabled by INFERCORE_NATIVE_CPU=0"
        else:
            try:
                _lib = _build()
            except Exception as e:  # noqa: BLE001 - any build / load failure leaves the ATen paths in place
                _error = f"{type(e).__name__}: {e}"
            if _lib is not None and os.environ.get("INFERCORE_CPU_INT8_ACTIVATIONS", "0") == "1":
                _lib.infercore_set_a8(1)
    return _lib


def set_int8_activations(on: bool) -> bool:
    """Switch the native INT4 GEMVs (INT4 groups, GGUF Q4_0 / Q4_1 / Q4_K) and INT8 ones over rows of a multiple of
    64 (w8a16, GGUF Q8_0 / Q6_K / "mixed"), standalone and in the fused decoder layers, to 8-bit activations,
    llama.cpp's design: each token row rounded to int8 in blocks of 32 with an fp32 scale per block (``max |x| /
    127``), the products taken by AVX512-VNNI's ``vpdpbusd`` (64 u8 x s8 products an instruction, exact in int32)
    instead of bf16 dot products (32). Off by default: the activations' rounding changes the results (the zeros'
    term keeps the exact bf16 sums). Also on at load with ``INFERCORE_CPU_INT8_ACTIVATIONS=1``. Returns whether it is
    on: False where the host has no AVX512-VNNI or the native kernels are unavailable."""
    lib = _load()
    return bool(lib.infercore_set_a8(int(bool(on)))) if lib is not None else False


def int8_activations_on() -> bool:
    """Whether the native INT4 / INT8 GEMVs take 8-bit activations now (:func:`set_int8_activations`)."""
    lib = _load()
    return lib is not None and bool(lib.infercore_a8_active())


@contextmanager
def int8_activations(on: bool = True):
    """:func:`set_int8_activations` within a block, the previous setting restored after it."""
    before = int8_activations_on()
    set_int8_activations(on)
    try:
        yield int8_activations_on()
    finally:
        set_int8_activations(before)


@contextmanager
def _attention_mode(mode: int):
    lib = _need()
    before = int(lib.infercore_set_attn_simd(mode))
    try:
        yield before > 0
    finally:
        lib.infercore_set_attn_simd(before)


def scalar_attention():
    """Context manager: within it the native decode attention (standalone and in the fused decoder layers) runs its
    scalar loops instead of the AVX-512 tiles (``attend_simd`` in ``ops/cpu_kernels.c``): for A/B timing. Yields
    whether the vector path was on before."""
    return _attention_mode(0)


def unsplit_attention():
    """Context manager: the AVX-512 decode attention without its key splits (:func:`attention_splits` answers 1):
    for A/B timing. Yields whether the vector path was on before."""
    return _attention_mode(1)


def attention_splits(batch: int, kv_heads: int, head_dim: int, group: int, max_len: int,
                     threads: int | None = None) -> int:
    """How many parts the native decode attention cuts each (sequence, KV head)'s keys into (partials merged after):
    more than 1 where ``batch * kv_heads`` units are fewer than ``threads`` (default torch's), the AVX-512 path runs,
    and each part keeps at least 256 keys of the longest sequence."""
    n = torch.get_num_threads() if threads is None else threads
    return int(_need().infercore_attn_splits(batch, kv_heads, head_dim, group, max_len, n))


@contextmanager
def disabled():
    """Within this block the native kernels report unavailable, so the callers that check :func:`available`
    per call (``models.layout.CPUPackedLinear``) take their ATen / oneDNN paths: for A/B timing."""
    global _lib, _error, _tried
    _load()
    saved = _lib, _error, _tried
    _lib, _error, _tried = None, "disabled within cpu_native.disabled()", True
    try:
        yield
    finally:
        _lib, _error, _tried = saved


def available() -> bool:
    """Whether the native host kernels built and loaded here."""
    return _load() is not None


def status() -> str:
    """``"avx512-bf16"`` / ``"avx512"`` / ``"scalar"`` (the instructions the build uses), or why it is off."""
    lib = _load()
    if lib is None:
        return f"unavailable: {_error}"
    return {2: "avx512-bf16", 1: "avx512", 0: "scalar"}[lib.infercore_native_isa()]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _need():
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native host kernels: {_error}")
    return lib


def _pairs(ids: torch.Tensor, E: int, expert_offset: int | None):
    """The routed (expert, token) pairs in the reference's order (expert, then token, then slot), as the kernels
    take them: ``(G, meta int64 [experts G, offsets G + 1, tokens P], pair indices)``; pairs outside
    ``[0, E)`` skipped with ``expert_offset``, refused without (``ValueError`` naming the smallest)."""
    k = ids.shape[1]
    off = 0 if expert_offset is None else expert_offset
    groups: dict[int, list[int]] = {}
    for p, e in enumerate(ids.reshape(-1).tolist()):
        groups.setdefault(e - off, []).append(p)
    bad = [e for e in groups if not 0 <= e < E]
    if bad and expert_offset is None:  # the smallest, as the reference (sorted ids) names it
        raise ValueError(f"moe_experts: expert id {min(bad)} is outside [0, {E})")
    for e in bad:
        del groups[e]
    experts = sorted(groups)
    pairs = [p for e in experts for p in groups[e]]
    counts = [0]
    for e in experts:
        counts.append(counts[-1] + len(groups[e]))
    meta = torch.tensor([*experts, *counts, *[p // k for p in pairs]], dtype=torch.int64)
    return len(experts), meta, pairs


def _moe(fn, x, H, I, weight_args, weights, ids, E, expert_offset, groups: tuple[int, int] | None = None,
         ) -> torch.Tensor:  # fmt: skip
    """One native MoE call; ``groups``: quantized experts' sums per token row of H and per pair row of I."""
    T = x.shape[0]
    G, meta, pairs = _pairs(ids, E, expert_offset)
    P = len(pairs)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    if P == 0:
        return out.zero_()
    x = x.contiguous()
    pw = weights.reshape(-1).float()[torch.tensor(pairs)].contiguous()
    ws = torch.empty(P * (3 * I + H), dtype=torch.bfloat16)  # gate_up outputs, SiLU-and-mul, down outputs
    acc = torch.empty(T * H, dtype=torch.float32)
    base = _ptr(meta)
    sums = torch.empty(T * groups[0] + P * groups[1] if groups else 0, dtype=torch.float32)  # kept alive here
    fn(_ptr(x), T, H, I, *weight_args, G, base, base + 8 * G, base + 8 * (2 * G + 1), _ptr(pw), _ptr(ws),
       _ptr(ws) + 2 * P * 2 * I, _ptr(ws) + 2 * P * 3 * I, _ptr(acc), _ptr(out), *((_ptr(sums),) if groups else ()),
       torch.get_num_threads())
    return out


def moe_experts_bf16(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, expert_offset: int | None = None) -> torch.Tensor:  # fmt: skip
    """``ops.moe.naive.moe_experts_ref`` for bf16 host tensors through the native kernel: ``x [T, H]``,
    ``gate_up [E, 2I, H]`` / ``down [E, H, I]`` contiguous, ``weights / ids [T, k]`` (checked by the caller) ->
    ``[T, H]`` bf16. Pairs are taken expert by expert, then token, then slot (the reference's order); pairs
    routed outside ``[0, E)`` are skipped with ``expert_offset`` and refused (``ValueError``) without."""
    lib = _need()
    E, I2, H = gate_up.shape
    return _moe(lib.infercore_moe_experts_bf16, x, H, I2 // 2, (_ptr(gate_up), _ptr(down)), weights, ids, E,
                expert_offset)


Q4_GROUP = 128  # the MoE experts kernel's group (moe_experts_q4)
Q4_GROUPS = (32, 64, 128, 256)  # the groups the INT4 GEMVs take (linear_q4, the fused decoder layer)
Q5F = 1 << 16  # the fused layer's group value of a 5-bit linear is Q5F | 32 (cpu_kernels.c)
FP8F = 1 << 22  # ... of an FP8 one FP8F | 0 (per-row scales) or FP8F | 128 (128 x 128 blocks)
LUT4F = 1 << 23  # ... of a 4-bit codebook one (NF4Weight) LUT4F | blocksize
KF = 1 << 20  # a group value | KF: sz in the two-level form of the GGUF K-quants (cpu_experts.c, expand_kform)
A8F = 1 << 21  # an INT4 GEMV's group value | A8F: 8-bit activations (set_int8_activations)


def operand_group(kp: int, sz: torch.Tensor) -> tuple[int, bool]:
    """``(g, two_level)`` of native operands with ``kp`` input features: ``sz [N, 2 or 3, Kp / g]`` (plain), or
    ``[N, 1, 2 Kp / 256 + Kp / g / 2]`` (the two-level form, :func:`_kform`: g 32 or 16)."""
    if sz.shape[1] != 1:
        return kp // sz.shape[2], False
    g = {3 * kp: 32, 5 * kp: 16}.get(sz.shape[2] * 128)
    if g is None or kp % 256:
        raise ValueError(f"sz {tuple(sz.shape)}: not the two-level form of {kp} input features")
    return g, True


def _kform(d: torch.Tensor, z: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The two-level form of a GGUF K-quant's scales and zeros, ``[N, 1, 2 nS + nG / 2]`` fp32: per row ``D``,
    ``Z`` (fp32 ``[N, nS]``, per super-block of 256) then ``sc`` and ``m`` (int8 ``[N, nG]``, per group, their bytes
    kept in the fp32 tensor), ``scale_j = D_b sc_j`` and ``zero_j = Z_b m_j``."""
    n = d.shape[0]
    return torch.cat([d.float(), z.float(), sc.to(torch.int8).reshape(n, -1).contiguous().view(torch.float32),
                      m.to(torch.int8).reshape(n, -1).contiguous().view(torch.float32)], 1)[:, None].contiguous()


def q4_supported() -> bool:
    """Whether the native INT4 and INT8 kernels run vectorized here (AVX512-BF16; elsewhere the callers keep ATen's
    kernels or the reference)."""
    return available() and status() == "avx512-bf16"


def _q4_operands(nib: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: int):
    """``(codes uint8 [N, K / 2], sz fp32 [N, 2, K / g])`` from codes ``nib [N, K]`` in [0, 16) and fp32 ``scale`` /
    ``zero`` ``[N, K / g]`` with ``w = (nib - 8) * scale + zero``, in the kernels' layout (``cpu_experts.c``): each
    span of 64 elements in 32 bytes, byte ``b`` holding element ``b`` in its low nibble and ``32 + b`` in its high
    one (a 32-element tail: ``b`` and ``16 + b``); ``sz`` the scales, then the zeros of ``w = (128 + nib) * scale
    + zero'`` (``zero' = zero - 136 scale``), as the kernels read each code as the bf16 of ``128 + nib``."""
    n, k = nib.shape
    q = nib.to(torch.uint8)
    k64 = k // 64 * 64
    spans = q[:, :k64].reshape(n, k64 // 64, 2, 32)
    tail = q[:, k64:].reshape(n, -1, 2, 16)
    codes = torch.cat([(spans[:, :, 0] | (spans[:, :, 1] << 4)).reshape(n, -1),
                       (tail[:, :, 0] | (tail[:, :, 1] << 4)).reshape(n, -1)], 1).contiguous()
    scale = scale.float()
    return codes.cpu(), torch.stack([scale, zero.float() - 136.0 * scale], 1).contiguous().cpu()


def pack_q4(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT4 operands of a 4-bit :class:`~infercore.quant.formats.IntWeight` with groups of
    :data:`Q4_GROUPS` along K: ``(codes uint8 [N, Kp / 2], sz fp32 [N, 2, Kp / g])`` (:func:`_q4_operands` of
    ``scale = s`` and ``zero = (8 - z) * s``); None for other formats."""
    from ...quant.formats import IntWeight

    if not isinstance(w, IntWeight) or w.bits != 4 or w.group_size not in Q4_GROUPS:
        return None
    kp, g = w.padded_in_features, w.group_size
    if kp % g or w.scales.shape[1] != kp // g:
        return None
    s = w.scales.float()
    return _q4_operands(w.codes(), s, (8.0 - w.zero_points()) * s, g)


def gguf_bits(w) -> int | None:
    """Which native GEMV runs a :class:`~infercore.quant.formats.GGUFWeight`: 4 (the INT4 one, groups of 32: Q4_0 /
    Q4_1 / Q4_K, or a "mixed" weight of those alone), 5 (the INT4 one with a plane of fifth bits: Q5_0 / Q5_1 / Q5_K),
    8 (the INT8 one: Q8_0 / Q6_K, or a "mixed" weight with any part not 4-bit, its parts' codes then read as bytes),
    None for anything else."""
    from ...quant.formats import GGUFWeight
    from ...quant.gguf import BLOCK_BYTES

    if not isinstance(w, GGUFWeight):
        return None
    qtypes = [q for q, _ in w.parts] if w.qtype == "mixed" else [w.qtype]
    if any(q not in BLOCK_BYTES for q in qtypes):
        return None
    if all(q in ("q4_0", "q4_1", "q4_k") for q in qtypes):
        return 4
    return 5 if w.qtype in ("q5_0", "q5_1", "q5_k") else 8


def _k_levels(w) -> tuple[torch.Tensor, ...]:
    """``(D, Z, sc, m)`` of :func:`_kform` for GGUF Q4_K (``d``, ``-dmin``, 6-bit scales and mins) or Q6_K blocks
    (``d``, ``-32 d``, the int8 scales twice)."""
    from ...quant.gguf import BLOCK_BYTES, _f16, _k_scale_min

    n = w.raw.shape[0]
    blocks = w.raw.cpu().reshape(n, -1, BLOCK_BYTES[w.qtype])
    if w.qtype == "q4_k":
        sc, mn = _k_scale_min(blocks[..., 4:16])
        return _f16(blocks, 0), -_f16(blocks, 2), sc, mn
    d, sc = _f16(blocks, 208), blocks[..., 192:208].contiguous().view(torch.int8)
    return d, -32.0 * d, sc, sc


def pack_gguf_q4(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT4 operands (groups of 32) of GGUF blocks :func:`gguf_bits` gives 4 (a
    :class:`~infercore.quant.formats.GGUFWeight`): :func:`_q4_operands` of the blocks' 4-bit codes with, in fp32,
    ``scale = d`` and ``zero = m + 8 d`` (0 for Q4_0), or each sub-block's ``scale`` and ``zero + 8 scale``
    (``GGUFWeight.affine``: Q4_K, "mixed"); None for other formats."""
    from ...quant.gguf import BLOCK_BYTES, q4_parts

    if gguf_bits(w) != 4:
        return None
    if w.qtype not in ("q4_0", "q4_1"):
        codes, scale, zero = w.affine()
        q4, sz = _q4_operands(codes, scale, zero + 8.0 * scale, 32)
        if w.qtype == "q4_k":  # the blocks' own 6-bit scales and mins under fp32 d and -dmin: 0.09 bytes a weight
            return q4, _kform(*_k_levels(w))
        return q4, sz
    n = w.raw.shape[0]
    nib, d, m = q4_parts(w.raw.reshape(n, -1, BLOCK_BYTES[w.qtype]), w.qtype)
    zero = torch.zeros_like(d) if w.qtype == "q4_0" else m + 8.0 * d
    return _q4_operands(nib.reshape(n, -1), d, zero, 32)


def moe_experts_q4(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor],
                   down: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, ids: torch.Tensor,
                   expert_offset: int | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`moe_experts_bf16` over INT4 experts: ``gate_up = (codes [E, 2I, H / 2], sz [E, 2I, 2, H / 128])``,
    ``down = (codes [E, H, I / 2], sz [E, H, 2, I / 128])`` (:func:`pack_q4` per expert, stacked; H and I
    multiples of 128)."""
    lib = _need()
    E, I2, H = gate_up[0].shape[0], gate_up[0].shape[1], gate_up[0].shape[2] * 2
    args = (_ptr(gate_up[0]), _ptr(gate_up[1]), _ptr(down[0]), _ptr(down[1]))
    return _moe(lib.infercore_moe_experts_q4, x, H, I2 // 2, args, weights, ids, E, expert_offset,
                groups=(H // Q4_GROUP, I2 // 2 // Q4_GROUP))


def moe_experts_q8(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor],
                   down: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, ids: torch.Tensor,
                   expert_offset: int | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`moe_experts_bf16` over INT8 experts symmetric per channel: ``gate_up = (codes [E, 2I, H], sz
    [E, 2I, 2, 1])``, ``down = (codes [E, H, I], sz [E, H, 2, 1])`` (:func:`pack_q8` per expert, stacked)."""
    lib = _need()
    E, I2, H = gate_up[0].shape
    args = (_ptr(gate_up[0]), _ptr(gate_up[1]), _ptr(down[0]), _ptr(down[1]))
    return _moe(lib.infercore_moe_experts_q8, x, H, I2 // 2, args, weights, ids, E, expert_offset, groups=(1, 1))


def _linear_quant(fn, name: str, x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, kp: int,
                  a8_ok: bool = False) -> torch.Tensor:
    """One native INT4 / INT8 GEMV call ``fn`` over operands with ``kp`` (padded) input features: ``x [M, K]`` bf16
    on the CPU, ``K <= kp`` (zero-padded to kp here) -> ``[M, N]`` bf16 (``a8_ok``: ``fn`` takes 8-bit activations
    here where they are on). Bad ``x``: ``TypeError`` / ``ValueError``."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise TypeError(f"{name}: x must be a bf16 CPU tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] > kp:
        raise ValueError(f"{name}: x must be [M, K] with K <= {kp} (the weight's input features), got "
                         f"{tuple(x.shape)}")
    M, K = x.shape
    N, (g, two_level) = codes.shape[0], operand_group(kp, sz)
    x = torch.nn.functional.pad(x, (0, kp - K)) if kp > K else x.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16)
    # the rows' group sums, and for 8-bit activations their int8 rows and block scales (cpu_experts.c, act_floats)
    a8 = A8F if a8_ok and _need().infercore_a8_active() else 0
    sums = torch.empty(M * (kp // g + (kp // 2 if a8 else 0)), dtype=torch.float32)
    fn(_ptr(x), M, kp, _ptr(codes), _ptr(sz), g | (KF if two_level else 0) | a8, N, _ptr(y), _ptr(sums),
       torch.get_num_threads())
    return y


def linear_q4(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T`` for bf16 ``x`` and :func:`pack_q4` / :func:`pack_gguf_q4`'s operands
    ``[N, Kp / 2]`` / ``[N, 2, Kp / g]`` (``x`` zero-padded to Kp) -> ``[M, N]`` bf16."""
    return _linear_quant(_need().infercore_linear_q4, "linear_q4", x, codes, sz, codes.shape[1] * 2, a8_ok=True)


def pack_q8(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT8 operands of an 8-bit symmetric per-channel :class:`~infercore.quant.formats.IntWeight` (the
    ``w8a16`` scheme): ``(codes uint8 [N, Kp], sz fp32 [N, 2, 1])``, one group a row (the codes are the weight's
    own bytes, ``w = (q - 128) * s``; sz: ``s`` and ``-2304 s``, see ``cpu_experts.c``); None for other formats."""
    from ...quant.formats import IntWeight

    if not isinstance(w, IntWeight) or w.bits != 8 or not w.symmetric or w.scales.shape[1] != 1:
        return None
    # a new tensor over the same bytes: the repack cache (quant.repacks) must not hold the weight's own tensor
    codes = w.qweight.cpu().contiguous().detach()
    s = w.scales[:, :1].float().cpu()
    return codes, torch.stack([s, -2304.0 * s], 1).contiguous()


def pack_gguf_q5(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native 5-bit operands (groups of 32) of GGUF Q5_0 / Q5_1 / Q5_K blocks (a
    :class:`~infercore.quant.formats.GGUFWeight`): :func:`_q4_operands` of the codes' low four bits with each
    sub-block's ``scale`` and ``zero + 8 scale`` (``GGUFWeight.affine``: ``w = u scale + zero``), and a third plane
    of ``sz`` (``[N, 3, K / 32]``) holding each group's fifth bits as one 32-bit word, bit i for element i (the
    bytes of an int32 kept as fp32); None for other formats."""
    if gguf_bits(w) != 5:
        return None
    codes, scale, zero = w.affine()
    q4, sz = _q4_operands(codes & 15, scale, zero + 8.0 * scale, 32)
    n, k = codes.shape
    bits = ((codes >> 4) & 1).reshape(n, k // 32, 32).to(torch.int64) << torch.arange(32)
    words = bits.sum(-1)
    words = (words - (words >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    return q4, torch.cat([sz, words[:, None]], 1).contiguous()


def linear_q5(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T`` for bf16 ``x`` and :func:`pack_gguf_q5`'s operands ``[N, K / 2]`` /
    ``[N, 3, K / 32]`` -> ``[M, N]`` bf16."""
    return _linear_quant(_need().infercore_linear_q5, "linear_q5", x, codes, sz, codes.shape[1] * 2)


def pack_gguf_q8(w) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native INT8 operands of GGUF blocks :func:`gguf_bits` gives 8 (a
    :class:`~infercore.quant.formats.GGUFWeight`: Q8_0 in groups of 32, Q6_K in groups of 16, or "mixed" in its
    smallest sub-block): ``(codes uint8 [N, K], sz fp32 [N, 2, K / g])``; Q8_0's signed codes q
    stored as ``q + 128`` with sz ``d`` and ``-2304 d``, the others' unsigned codes u as they are
    (``GGUFWeight.affine``: ``w = u scale + zero``) with sz ``scale`` and ``zero - 2176 scale`` (see
    ``cpu_experts.c``); None for other formats."""
    from ...quant.gguf import BLOCK_BYTES, _f16

    if gguf_bits(w) != 8:
        return None
    if w.qtype != "q8_0":
        codes, scale, zero = w.affine()
        if w.qtype == "q6_k":  # its int8 scales under fp32 d (zero: -32 d sc): 0.08 bytes a weight
            return codes.contiguous(), _kform(*_k_levels(w))
        return codes.contiguous(), torch.stack([scale, zero - 2176.0 * scale], 1).contiguous()
    n = w.raw.shape[0]
    blocks = w.raw.cpu().reshape(n, -1, BLOCK_BYTES["q8_0"])
    codes = (blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(n, -1)
    d = _f16(blocks, 0).float()
    return codes.contiguous(), torch.stack([d, -2304.0 * d], 1).contiguous()


def linear_q8(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ dequant(w)^T`` for bf16 ``x`` and :func:`pack_q8` / :func:`pack_gguf_q8`'s operands ``[N, Kp]`` /
    ``[N, 2, Kp / g]`` (``x`` zero-padded to Kp) -> ``[M, N]`` bf16."""
    kp = codes.shape[1]  # 8-bit activations where Kp is a multiple of 64
    return _linear_quant(_need().infercore_linear_q8, "linear_q8", x, codes, sz, kp, a8_ok=kp % 64 == 0)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    """``x [M, K]`` bf16 ``@ dequant(w)^T`` for e4m3 codes ``[N, K]`` (uint8, contiguous) with fp32 ``scales``: one a
    row (``block`` None, ``[N]``) or per 128 x 128 block (``block`` 128, ``[ceil(N / 128), ceil(K / 128)]``) ->
    ``[M, N]`` bf16. Each code is decoded to its exact bf16, the products summed in fp32 within a block and scaled
    there (the reference scales each weight first: the sums differ by fp32 rounding)."""
    lib = _lib if _tried and _lib is not None else _need()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"linear_fp8: x must be bf16, got {x.dtype}")
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"linear_fp8: a host x [M, K] expected, got {tuple(x.shape)} on {x.device}")
    M, K = x.shape
    N = codes.shape[0] if codes.dim() else 0
    _fp8_operands("linear_fp8", codes, scales, block, K)
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16)
    lib.infercore_linear_fp8(x.data_ptr(), M, K, codes.data_ptr(), scales.data_ptr(), block or 0, N, y.data_ptr(),
                             torch.get_num_threads())
    return y


def _fp8_operands(fn: str, codes: torch.Tensor, scales: torch.Tensor, block: int | None, K: int) -> None:
    """``TypeError`` / ``ValueError`` unless ``codes`` are host uint8 ``[N, K]`` with fp32 ``scales`` of the layout
    ``block`` (None: ``[N]``; 128: ``[ceil(N / 128), ceil(K / 128)]``)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"{fn}: codes uint8 and scales fp32 expected, got {codes.dtype}, {scales.dtype}")
    if codes.dim() != 2 or codes.shape[1] != K or block not in (None, 128):
        raise ValueError(f"{fn}: codes [N, {K}] and block None or 128 expected, got {tuple(codes.shape)}, "
                         f"block {block!r}")
    if codes.device.type != "cpu" or scales.device.type != "cpu":
        raise ValueError(f"{fn}: host tensors expected, got codes on {codes.device}, scales on {scales.device}")
    N = codes.shape[0]
    want = (N,) if block is None else (-(-N // 128), -(-K // 128))
    if tuple(scales.shape) != want:
        raise ValueError(f"{fn}: scales must be {want}, got {tuple(scales.shape)}")


def dequant_fp8_rows(codes: torch.Tensor, scales: torch.Tensor, block: int | None, r0: int, r1: int,
                     out: torch.Tensor) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the weight behind e4m3 ``codes [N, K]`` (uint8, contiguous) with fp32 ``scales`` (one a
    row, ``block`` None, or per 128 x 128 block, ``block`` 128; as :func:`linear_fp8`) decoded into the first
    ``r1 - r0`` rows of ``out`` (bf16, contiguous ``[>= r1 - r0, K]``): each code's value times its scale, rounded to
    bf16 (nearest even). Returns that slice. Bad arguments: ``TypeError`` / ``ValueError``."""
    lib = _need()
    if codes.dim() != 2 or not codes.is_contiguous() or not scales.is_contiguous():
        raise ValueError("dequant_fp8_rows: contiguous codes [N, K] and scales expected")
    K = codes.shape[1]
    _fp8_operands("dequant_fp8_rows", codes, scales, block, K)
    if not 0 <= r0 <= r1 <= codes.shape[0]:
        raise ValueError(f"dequant_fp8_rows: rows [{r0}, {r1}) outside the weight's {codes.shape[0]}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.dim() != 2 or out.shape[0] < r1 - r0 \
            or out.shape[1] != K:
        raise ValueError(f"dequant_fp8_rows: out must be a contiguous bf16 [>= {r1 - r0}, {K}] tensor")
    lib.infercore_dequant_fp8_rows(_ptr(codes), _ptr(scales), K, block or 0, r0, r1, _ptr(out),
                                   torch.get_num_threads())
    return out[: r1 - r0]


def _lut4_operands(fn: str, codes: torch.Tensor, absmax: torch.Tensor, lut: torch.Tensor) -> tuple[int, int, int]:
    """``(N, K, blocksize)`` of NF4 operands, checked (``TypeError`` / ``ValueError`` naming ``fn``)."""
    if codes.dtype != torch.uint8 or absmax.dtype != torch.float32 or lut.dtype != torch.float32:
        raise TypeError(f"{fn}: codes uint8, absmax and lut fp32 expected, got {codes.dtype}, {absmax.dtype}, "
                        f"{lut.dtype}")
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in (codes, absmax, lut)):
        raise ValueError(f"{fn}: contiguous host tensors expected")
    if codes.dim() != 2 or absmax.dim() != 2 or lut.shape != (16,):
        raise ValueError(f"{fn}: codes [N, K / 2], absmax [N, blocks], lut [16] expected, got {tuple(codes.shape)}, "
                         f"{tuple(absmax.shape)}, {tuple(lut.shape)}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    nb = absmax.shape[1]
    if absmax.shape[0] != n or nb < 1 or k % nb or (k // nb) % 2:
        raise ValueError(f"{fn}: absmax {tuple(absmax.shape)} does not fit codes {tuple(codes.shape)}")
    return n, k, k // nb


def lut4_operands(w) -> torch.Tensor | None:
    """The fp32 ``[16 + N * K / blocksize]`` operand of an :class:`~infercore.quant.NF4Weight` on the host: its
    codebook followed by its absmax, made once and kept beside the weight (:func:`linear_lut4` and the fused decoder
    layers read it), or None during CUDA-graph capture before it exists."""
    from ...quant.repacks import packed

    return packed(w.qweight, ("cpu", "lut4"), lambda: torch.cat([w.codebook.float().reshape(16),
                                                                 w.absmax.float().reshape(-1)]).contiguous())


def linear_lut4(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, lut: torch.Tensor,
                lutabs: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` bf16 ``@ (lut[code] * absmax)^T`` for 4-bit codes ``[N, K / 2]`` (uint8, element ``2j`` in the low
    nibble of byte ``j``) into the fp32 codebook ``lut [16]`` with fp32 ``absmax [N, K / blocksize]``
    (:class:`~infercore.quant.NF4Weight`; ``lutabs``: the two concatenated, :func:`lut4_operands`, else made here)
    -> ``[M, N]`` bf16: each code's codebook value times its block's absmax (fp32, as the reference scales each
    weight) times the activation, summed in fp32 in another order than the reference's GEMM. No copy of the
    weight."""
    lib = _lib if _tried and _lib is not None else _need()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"linear_lut4: x must be bf16, got {x.dtype}")
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"linear_lut4: a host x [M, K] expected, got {tuple(x.shape)} on {x.device}")
    n, k, bs = _lut4_operands("linear_lut4", codes, absmax, lut)
    if x.shape[1] != k:
        raise ValueError(f"linear_lut4: x has K = {x.shape[1]}, the codes {k}")
    if lutabs is None:
        lutabs = torch.cat([lut, absmax.reshape(-1)])
    elif lutabs.dtype != torch.float32 or not lutabs.is_contiguous() or lutabs.numel() != 16 + absmax.numel():
        raise ValueError(f"linear_lut4: lutabs must be a contiguous fp32 [{16 + absmax.numel()}] tensor")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if lib.infercore_linear_lut4(_ptr(x), x.shape[0], k, _ptr(codes), _ptr(lutabs), bs, n, _ptr(y),
                                 torch.get_num_threads()):
        raise MemoryError("linear_lut4: no memory for the activation buffer")
    return y


def dequant_lut4_rows(codes: torch.Tensor, absmax: torch.Tensor, lut: torch.Tensor, r0: int, r1: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the weight behind 4-bit codes ``[N, K / 2]`` (uint8, element ``2j`` in the low nibble of
    byte ``j``) into the fp32 codebook ``lut [16]``, scaled by fp32 ``absmax [N, K / blocksize]`` (bitsandbytes NF4 /
    FP4, :class:`~infercore.quant.NF4Weight`), decoded into the first ``r1 - r0`` rows of ``out`` (bf16, contiguous
    ``[>= r1 - r0, K]``): ``lut[code] * absmax`` rounded to bf16 (nearest even). Returns that slice. Bad arguments:
    ``TypeError`` / ``ValueError``."""
    lib = _need()
    n, k, bs = _lut4_operands("dequant_lut4_rows", codes, absmax, lut)
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"dequant_lut4_rows: rows [{r0}, {r1}) outside the weight's {n}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.dim() != 2 or out.shape[0] < r1 - r0 \
            or out.shape[1] != k:
        raise ValueError(f"dequant_lut4_rows: out must be a contiguous bf16 [>= {r1 - r0}, {k}] tensor")
    lib.infercore_dequant_lut4_rows(_ptr(codes), _ptr(absmax), _ptr(lut), k, bs, r0, r1, _ptr(out),
                                    torch.get_num_threads())
    return out[: r1 - r0]


def dequant_rows(codes: torch.Tensor, sz: torch.Tensor, bits: int, r0: int, r1: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Rows ``[r0, r1)`` of the weight behind the native INT4 (``bits=4``; :func:`pack_q4` / :func:`pack_gguf_q4`:
    codes uint8 ``[N, Kp / 2]``), 5-bit (``bits=5``; :func:`pack_gguf_q5`: the same codes, sz ``[N, 3, Kp / 32]``) or
    INT8 (``bits=8``; :func:`pack_q8` / :func:`pack_gguf_q8`: ``[N, Kp]``) operands (sz fp32 ``[N, 2, Kp / g]``),
    decoded into the first ``r1 - r0`` rows of ``out`` (bf16, contiguous
    ``[>= r1 - r0, Kp]``): the values the native GEMVs multiply by, rounded to bf16. Returns that slice. Bad
    arguments: ``TypeError`` / ``ValueError``."""
    lib = _need()
    if codes.dtype != torch.uint8 or codes.dim() != 2 or not codes.is_contiguous() or sz.dtype != torch.float32 \
            or sz.dim() != 3 or not sz.is_contiguous():
        raise TypeError("dequant_rows: codes must be contiguous uint8 [N, Kp / 2 or Kp], sz contiguous fp32 "
                        "[N, 2, groups]")
    if bits not in (4, 5, 8):
        raise ValueError(f"dequant_rows: bits must be 4, 5 or 8, got {bits!r}")
    n = codes.shape[0]
    kp = codes.shape[1] * (1 if bits == 8 else 2)
    g, two_level = operand_group(kp, sz)
    ng = kp // g if two_level else sz.shape[2]
    if two_level:
        ok = sz.shape[:2] == (n, 1) and kp % 256 == 0 and sz.shape[2] == 2 * kp // 256 + ng // 2 and bits != 5 \
            and g == (32 if bits == 4 else 16)
    else:
        ok = sz.shape[:2] == (n, 3 if bits == 5 else 2) and ng >= 1 and kp % ng == 0 and (bits != 5 or kp == 32 * ng)
    if not ok:
        raise ValueError(f"dequant_rows: sz {tuple(sz.shape)} does not fit codes {tuple(codes.shape)}")
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"dequant_rows: rows [{r0}, {r1}) outside the weight's {n}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.dim() != 2 or out.shape[0] < r1 - r0 \
            or out.shape[1] != kp:
        raise ValueError(f"dequant_rows: out must be a contiguous bf16 [>= {r1 - r0}, {kp}] tensor")
    lib.infercore_dequant_rows(_ptr(codes), _ptr(sz), kp, (kp // ng) | (KF if two_level else 0),
                               {4: 0, 8: 1, 5: 2}[bits], r0, r1, _ptr(out), torch.get_num_threads())
    return out[: r1 - r0]


def linear_dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` for host tensors both bf16 or both fp32 (``w`` contiguous) -> ``[M, N]`` in their
    dtype, fp32 sums. Other dtypes: ``TypeError``; mismatched K: ``ValueError``."""
    lib = _lib if _tried and _lib is not None else _need()
    if x.dtype != w.dtype or x.dtype not in _DT or not w.is_contiguous():
        raise TypeError(f"linear_dense: x {x.dtype} and a contiguous w {w.dtype} must both be bf16 or both fp32")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"linear_dense: x has K = {K}, w is {tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype)
    fn = lib.infercore_linear_f32 if x.dtype == torch.float32 else lib.infercore_linear_bf16
    fn(x.data_ptr(), M, K, w.data_ptr(), N, y.data_ptr(), torch.get_num_threads())
    return y


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the native read-only pass over an ``nbytes`` host buffer with torch's thread count, best of
    ``repeats`` (a floor for host GEMVs that the native kernels can approach)."""
    lib = _need()
    n = nbytes // 4096 * 4096
    buf = torch.ones(n, dtype=torch.uint8)
    lib.infercore_read_pass(_ptr(buf), n, torch.get_num_threads())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lib.infercore_read_pass(_ptr(buf), n, torch.get_num_threads())
        best = min(best, time.perf_counter() - t)
    return n / best


# The per-token ops of a decoder layer (cpu_kernels.c), for fp32 / bf16 host tensors. Callers (ops/*/cpu.py) check
# the layouts these take and keep their ATen paths otherwise; each wrapper's result equals its reference's up to
# the order of fp32 sums.

_layer_ops_on = True


@contextmanager
def layer_ops_disabled():
    """Within this block the layer ops keep their ATen paths while the native GEMVs / experts stay on: for A/B
    timing of the layer ops alone."""
    global _layer_ops_on
    saved, _layer_ops_on = _layer_ops_on, False
    try:
        yield
    finally:
        _layer_ops_on = saved


_fused_layers_on = True


@contextmanager
def fused_layers_disabled():
    """Within this block decoder layers run op by op (each op still native) instead of one
    :func:`llama_decode_layer` call: for A/B timing of the fusion alone."""
    global _fused_layers_on
    saved, _fused_layers_on = _fused_layers_on, False
    try:
        yield
    finally:
        _fused_layers_on = saved


def fused_layers_on() -> bool:
    return _fused_layers_on


_layer_stack_on = True


@contextmanager
def layer_stack_disabled():
    """Within this block a decode step calls :func:`llama_decode_layer` once per layer instead of
    :func:`llama_decode_layers` once for the whole stack: for A/B timing of the stacking alone."""
    global _layer_stack_on
    saved, _layer_stack_on = _layer_stack_on, False
    try:
        yield
    finally:
        _layer_stack_on = saved


def layer_stack_on() -> bool:
    return _layer_stack_on


def layer_ops_apply(*tensors: torch.Tensor) -> bool:
    """Whether the native layer ops take these tensors: built here, fp32 or bf16, all of one dtype, on the CPU."""
    if not (_layer_ops_on and available()):
        return False
    dt = tensors[0].dtype
    if dt not in _DT:
        return False
    for t in tensors:
        if t.dtype != dt or t.device.type != "cpu":
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``ops.norm.naive.rms_norm_ref`` (with ``residual``: ``fused_add_rms_norm_ref``) over the last dim of
    contiguous ``x`` (and ``residual``) -> ``(out, x + residual or None)``; ``weight`` fp32 or bf16 ``[D]``."""
    lib = _need()
    D = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    w = weight.contiguous()
    lib.infercore_rms_norm(_ptr(x), _ptr(residual) if residual is not None else None,
                           _ptr(res_out) if res_out is not None else None, _ptr(w), _ptr(out), x.numel() // D, D,
                           eps, offset, _DT[x.dtype], _DT[w.dtype], torch.get_num_threads())
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``ops.activation.naive`` SiLU-and-mul of contiguous ``x [..., 2d]`` -> ``[..., d]``, fp32 math."""
    lib = _need()
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    lib.infercore_silu_and_mul(_ptr(x), _ptr(out), x.numel() // (2 * d), d, _DT[x.dtype], torch.get_num_threads())
    return out


def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor,
                bounds: tuple[int, ...]) -> torch.Tensor:
    """``y [T, N] += `` each token's LoRA (``ops.lora_shrink`` then ``ops.lora_expand_`` with fp32 slots) in one
    call: x ``[T, K]`` and y contiguous fp32 / bf16 of one dtype, a fp32 ``[S, R, K]``, b fp32 ``[S, N, r]``
    (contiguous), idx int64 ``[T]`` on the host (-1: none), at most 3 ``bounds``. Returns y."""
    lib = _need()
    T, K = x.shape
    N, r = b.shape[1], b.shape[2]
    bnd = (*bounds, N, N, N)[:3]
    lib.infercore_lora_apply(_ptr(x), _ptr(y), _ptr(a), _ptr(b), _ptr(idx), T, K, N, a.shape[1], r, *bnd,
                             _DT[x.dtype], torch.get_num_threads())
    return y


_KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}  # 1-byte caches as the native kernels name them


def kv_codes(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> int:
    """The native kernels' cache mode: 0 a cache of the rows' dtype (no scales), 1 int8 / 2 float8_e4m3fn codes."""
    return 0 if k_scale is None else _KV_CODES[k_cache.dtype]


def attention_reads_codes(head_dim: int, group: int) -> bool:
    """Whether the native decode attention (and so the fused decoder layers) reads 1-byte KV caches at this head dim
    and query-head group (its AVX-512 path: head dims of a multiple of 16 up to 256, groups of up to 16)."""
    return bool(_need().infercore_att_codes_ok(head_dim, group))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Neox RoPE over the full head dim of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (fp32 ``cos_sin_cache [*, D]``),
    rotated k and v written to contiguous caches ``[pages, page_size, Hk, D]`` of q's dtype at ``slot_mapping``
    (slot -1: not stored) -> rotated q. With ``k_scale`` / ``v_scale`` (contiguous fp32 ``[pages, page_size, Hk]``)
    the caches are int8 / float8_e4m3fn codes: each stored row (the rotated key rounded to q's dtype, the value) is
    quantized as ``ops.kv_cache.quant.quantize_kv_ref`` does it, bit for bit."""
    lib = _need()
    T, Hq, D = q.shape
    Hk = k.shape[1]
    # rows of any stride with their heads contiguous (q / k / v as views of a fused qkv output) are read in place
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == D else t.contiguous() for t in (q, k, v))
    pos, slots = _int_rows(positions, slot_mapping)
    cs = cos_sin_cache.contiguous()
    out = torch.empty(T, Hq, D, dtype=q.dtype)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    kv = kv_codes(k_cache, k_scale)
    rc = lib.infercore_rope_write_kv(_ptr(q), _ptr(k), _ptr(v), _ptr(pos), _ptr(cs), _ptr(k_cache), _ptr(v_cache),
                                     _ptr(slots), _ptr(out), T, Hq, Hk, D, q.stride(0), k.stride(0), v.stride(0),
                                     num_slots, cs.shape[0], _DT[q.dtype], _ptr(k_scale) if kv else None,
                                     _ptr(v_scale) if kv else None, kv, torch.get_num_threads())
    if rc < 0:  # nothing was written
        raise _rows_error("rope_and_write_kv", rc, slots, pos, num_slots, cs.shape[0])
    return out


def _rows_error(op: str, rc: int, slots: torch.Tensor, pos: torch.Tensor, num_slots: int, max_pos: int) -> IndexError:
    """The error of check_rows' code ``rc`` (``-1 - t``: slot of row t; ``-1 - T - t``: position of row t)."""
    T, i = slots.shape[0], -1 - rc
    if i < T:
        return IndexError(f"{op}: slot_mapping[{i}] = {int(slots[i])} is outside the cache's {num_slots} slots "
                          "(-1: not stored)")
    i -= T
    return IndexError(f"{op}: positions[{i}] = {int(pos[i])} is outside the rotary table's {max_pos} positions")


def _tables_error(op: str, rc: int, lens: torch.Tensor, bt: torch.Tensor, num_pages: int, ps: int) -> IndexError:
    """The error of check_tables' code ``rc`` (``-1 - b``: length of sequence b; ``-1 - B - b``: a page id of b)."""
    B, b = lens.shape[0], -1 - rc
    if b < B:
        return IndexError(f"{op}: seq_lens[{b}] = {int(lens[b])} needs more than the {bt.shape[1]} pages of "
                          f"block_table row {b} (page size {ps})")
    return IndexError(f"{op}: block_table row {b - B} names a page outside the cache's {num_pages} pages")


def _tables(seq_lens: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_lens`` as contiguous int32 and ``block_table`` as int32 with unit column stride (rows may be strided),
    as the native kernels read them."""
    lens = (seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()).contiguous()
    bt = block_table if block_table.dtype == torch.int32 else block_table.int()
    return lens, bt if bt.stride(-1) == 1 else bt.contiguous()


def _int_rows(positions: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` as contiguous int64 and ``slot_mapping`` as contiguous int32."""
    pos = positions if positions.dtype == torch.int64 else positions.long()
    slots = slot_mapping if slot_mapping.dtype == torch.int32 else slot_mapping.int()
    return pos.contiguous(), slots.contiguous()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, sliding_window: int | None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Paged decode attention of ``q [B, Hq, D]`` over contiguous caches ``[pages, page_size, Hk, D]`` of its dtype
    (``seq_lens [B]``, ``block_table [B, P]``; the last ``sliding_window`` keys where given) -> ``[B, Hq, D]``:
    fp32 scores, softmax and sum, the output rounded once; sequences of length <= 0 give zeros. With ``k_scale`` /
    ``v_scale`` (contiguous fp32 ``[pages, page_size, Hk]``) the caches are int8 / float8_e4m3fn codes
    (``ops.kv_cache.quant``): the AVX-512 path reads them as they are (value = code x scale); None where that path
    does not take the shape (nothing read: the caller falls back). Scales with other caches, one scale tensor without
    the other, or scales of another shape: ``TypeError`` / ``ValueError``."""
    lib = _need()
    B, Hq, D = q.shape
    _, ps, Hk, _ = k_cache.shape
    if (k_scale is None) != (v_scale is None):
        raise ValueError("decode_attention: k_scale and v_scale go together")
    if k_scale is not None:
        if k_cache.dtype not in (torch.int8, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
            raise TypeError(f"decode_attention: k_scale / v_scale need int8 or float8_e4m3fn caches, got "
                            f"{k_cache.dtype} / {v_cache.dtype}")
        if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]:
            raise ValueError(f"decode_attention: k_scale / v_scale must be {tuple(k_cache.shape[:3])}, got "
                             f"{tuple(k_scale.shape)} / {tuple(v_scale.shape)}")
    q = q.contiguous()
    lens, bt = _tables(seq_lens, block_table)
    out = torch.empty_like(q)
    num_pages = k_cache.shape[0]
    kv = kv_codes(k_cache, k_scale)
    ks, vs = (None, None) if k_scale is None else (k_scale.float().contiguous(), v_scale.float().contiguous())
    rc = lib.infercore_decode_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(lens), _ptr(bt), bt.stride(0),
                                        bt.shape[1], num_pages, B, Hq, Hk, D, ps, scale, sliding_window or 0,
                                        _ptr(out), _DT[q.dtype], _ptr(ks) if kv else None, _ptr(vs) if kv else None,
                                        kv, torch.get_num_threads())
    if rc < 0:  # nothing was read
        raise _tables_error("paged_attention_decode", rc, lens, bt, num_pages, ps)
    return None if rc == 1 else out


def layer_linear_store(lin):
    """The tensor whose identity :func:`layer_linear`'s answer for ``lin`` rests on (a dense weight, or a quantized
    layer's first buffer: its packed operands are kept beside it), so a caller may keep that answer while it is
    the same object; None for other modules."""
    params, buffers = lin.__dict__.get("_parameters", {}), lin.__dict__.get("_buffers", {})
    names = lin.__dict__.get("_names")
    return params.get("weight") if names is None else buffers.get(names[0]) if names else None


def layer_linear(lin, dtype: torch.dtype, *, bias_ok: bool = False) -> tuple[int, int, int, int] | None:
    """How :func:`llama_decode_layer` takes the linear module ``lin`` for activations of ``dtype``: ``(weight
    pointer, scales-and-zeros pointer, group, Kp)``, for a ``models.layout.CPUPackedLinear`` whose contiguous weight
    has ``dtype`` (group 0), or a ``quant.QuantLinear`` without input permutation over
    INT4 groups / GGUF Q4_0 / Q4_1 blocks that the native INT4 GEMV takes (``quant.cpu.native_q4``) or symmetric
    per-channel INT8 / GGUF Q8_0 blocks (``native_q8``, the group negated) or FP8 e4m3 weights with fp32 scales
    (group ``FP8F | block``) or 4-bit codebook (NF4) weights (group ``LUT4F | blocksize``, :func:`lut4_operands`),
    with bf16 activations; None for anything
    else. Either without bias, unless ``bias_ok``: then a contiguous bias of ``dtype`` is allowed (the caller passes
    it to the layer itself: qkv's, :func:`_qkv_bias`)."""
    from ...models.layout import CPUPackedLinear
    from ...quant.cpu import native_operands
    from ...quant.formats import FP8Weight, NF4Weight
    from ...quant.linear import QuantLinear

    b = lin.__dict__.get("_parameters", {}).get("bias")
    if b is not None and not (bias_ok and b.dtype == dtype and b.is_contiguous()):
        return None
    if type(lin) is CPUPackedLinear:
        w = lin._parameters["weight"]
        ok = w.dtype == dtype and w.is_contiguous()
        return (w.data_ptr(), 0, 0, w.shape[1]) if ok else None
    if type(lin) is QuantLinear and dtype == torch.bfloat16 and lin.in_perm is None:
        w = lin.qweight_format
        if isinstance(w, NF4Weight):  # the codes as stored, the codebook then absmax (quant.cpu.nf4_matmul_cpu's)
            ok = w.qweight.is_contiguous() and w.qweight.device.type == "cpu" and q4_supported()
            ops = lut4_operands(w) if ok else None
            return (w.qweight.data_ptr(), ops.data_ptr(), LUT4F | w.blocksize, w.shape[1]) if ops is not None else None
        if isinstance(w, FP8Weight):  # the codes as stored, fp32 scales (quant.cpu.fp8_wo_matmul_cpu's kernel)
            ok = (w.block_size in (None, 128) and w.qweight.is_contiguous() and w.scales.dtype == torch.float32
                  and w.scales.is_contiguous() and w.qweight.device.type == "cpu" and q4_supported())
            return (w.qweight.data_ptr(), w.scales.data_ptr(), FP8F | (w.block_size or 0), w.shape[1]) if ok else None
        ops = native_operands(w)
        if ops is not None:
            codes, sz, bits = ops
            kp = codes.shape[1] * (1 if bits == 8 else 2)
            g, two_level = operand_group(kp, sz)
            g |= KF if two_level else 0
            # a negative group: INT8; Q5F | 32: 5-bit codes; | KF: two-level scales (cpu_kernels.c)
            return codes.data_ptr(), sz.data_ptr(), {4: g, 5: Q5F | 32, 8: -g}[bits], kp
    return None


def llama_decode_layer(x: torch.Tensor, residual: torch.Tensor | None, layer, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                       linears: list[tuple[int, int, int, int]], k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, lora: tuple | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``models.llama.LlamaDecoderLayer.forward`` for ``T`` decode rows in one native call -> ``(mlp output [T, H],
    new residual [T, H])``, the same values as the op-by-op path. ``x`` / ``residual`` (or None in the first
    layer): ``[T, H]`` fp32 / bf16 like the layer's weights; ``positions [T]``; ``cos_sin_cache`` fp32 ``[max_pos,
    head_dim]``; caches ``[pages, page_size, Hk, head_dim]`` of x's dtype, or int8 / float8_e4m3fn codes with their
    ``k_scale`` / ``v_scale`` (fp32 ``[pages, page_size, Hk]``, contiguous; :func:`attention_reads_codes` must
    hold); ``meta`` a decode-only
    ``AttentionMetadata`` of ``T`` sequences; ``linears``: :func:`layer_linear` of qkv, o, gate_up and down. The
    caller checks that the layer and step fit (``LlamaDecoderLayer._native_decode``). Out-of-range slots,
    positions, page ids or sequence lengths raise ``IndexError`` before anything is written. ``lora``: ``(operands
    int64 [LORA_TAB], slots int64 [T])`` (``lora.LoRAManager.native_table`` row, ``host_slots``) to add each row's
    adapter after each projection, or None."""
    lib = _need()
    attn, mlp = layer.self_attn, layer.mlp
    T, H = x.shape
    x = x.contiguous()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    res = residual.contiguous() if residual is not None else None
    pos, slots = _int_rows(positions, meta.slot_mapping)
    lens, bt = _tables(meta.seq_lens, meta.block_table)
    num_pages, ps = k_cache.shape[0], k_cache.shape[1]
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    lin = (ctypes.c_int64 * 16)(*(v for t in linears for v in t))
    kv = kv_codes(k_cache, k_scale)
    rc = lib.infercore_llama_decode_layer(
        _ptr(x), _ptr(res) if res is not None else None, _ptr(res_out), _ptr(out), T, H,
        _ptr(n1.weight), n1.eps, lin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
        _ptr(pos), _ptr(cos_sin_cache), cos_sin_cache.shape[0], _ptr(k_cache), _ptr(v_cache), num_pages, ps,
        _ptr(slots), _ptr(lens), _ptr(bt), bt.stride(0), bt.shape[1], attn.scale, attn.sliding_window or 0,
        _ptr(n2.weight), n2.eps, mlp.down_proj.in_features, _DT[x.dtype], _ptr(k_scale) if kv else None,
        _ptr(v_scale) if kv else None, kv, *_qk_norms(attn), _qkv_bias(attn), torch.get_num_threads(),
        *((None, None) if lora is None else (_ptr(lora[0]), _ptr(lora[1]))))
    if rc == 1:
        raise ValueError("decoder layer: the native attention does not read 1-byte caches at this shape")
    if rc < 0:  # nothing was written
        if rc >= -2 * T:
            raise _rows_error("decoder layer", rc, slots, pos, num_pages * ps, cos_sin_cache.shape[0])
        raise _tables_error("decoder layer", rc + 2 * T, lens, bt, num_pages, ps)
    return out, res_out


LAYER_TAB = 27  # int64 entries per layer of llama_decode_layers' table (ops/cpu_kernels.c)
LORA_TAB = 28  # int64 LoRA operands per layer: qkv, o, gate_up, down, each (a, b, R, r, three slice bounds)


def _qkv_bias(attn) -> int | None:
    """The pointer to ``attn``'s qkv bias (Qwen2), or None."""
    b = attn.qkv_proj.__dict__.get("_parameters", {}).get("bias")
    return None if b is None else _ptr(b)


def _qk_norms(attn) -> tuple:
    """The fused layer's q / k norm operands of ``attn`` (Qwen3's per-head RMSNorm weights and their epsilon; the
    caller checked that both exist or neither): ``(q weight pointer, k weight pointer, eps)``, or (None, None, 0)."""
    qn, kn = attn.q_norm, attn.k_norm
    return (None, None, 0.0) if qn is None else (_ptr(qn.weight), _ptr(kn.weight), qn.eps)


def decode_layers_table(layers, kv_caches, linears: list) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llama_decode_layers`' per-layer operands: ``(table int64 [L, LAYER_TAB], eps fp32 [L, 3])`` from the
    layers, their ``(k_cache, v_cache)`` (with ``k_scale`` / ``v_scale`` for 1-byte caches,
    ``kv.cache.QuantizedKVCache``) and :func:`layer_linear` descriptors (pointers: valid while those tensors
    live)."""
    tab, eps = [], []
    for layer, cache, lin in zip(layers, kv_caches, linears):
        (k, v), ks, vs = cache, getattr(cache, "k_scale", None), getattr(cache, "v_scale", None)
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        kv = kv_codes(k, ks)
        qn, kn, qk_eps = _qk_norms(layer.self_attn)
        tab.append([n1.weight.data_ptr(), n2.weight.data_ptr(), k.data_ptr(), v.data_ptr(),
                    layer.self_attn.sliding_window or 0, *(e for t in lin for e in t),
                    ks.data_ptr() if kv else 0, vs.data_ptr() if kv else 0, kv, qn or 0, kn or 0,
                    _qkv_bias(layer.self_attn) or 0])
        eps.append([n1.eps, n2.eps, qk_eps])
    return torch.tensor(tab, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32)


def llama_decode_layers(x: torch.Tensor, layers, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        kv_caches, meta, table: tuple[torch.Tensor, torch.Tensor], lora: tuple | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack of :func:`llama_decode_layer` calls in one native call (the first layer's residual is ``x``):
    ``(last layer's MLP output [T, H], its residual [T, H])``, the same values. ``layers`` alike in shapes
    (heads, head_dim, intermediate size), their caches all of one shape; ``table``: :func:`decode_layers_table`;
    ``lora``: ``(operands int64 [L, LORA_TAB], slots int64 [T])`` or None (see :func:`llama_decode_layer`).
    Out-of-range indices raise ``IndexError`` before any layer runs."""
    lib = _need()
    attn, mlp = layers[0].self_attn, layers[0].mlp
    T, H = x.shape
    x = x.contiguous()
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    pos, slots = _int_rows(positions, meta.slot_mapping)
    lens, bt = _tables(meta.seq_lens, meta.block_table)
    k_cache = kv_caches[0][0]
    num_pages, ps = k_cache.shape[0], k_cache.shape[1]
    tab, eps = table
    rc = lib.infercore_llama_decode_layers(
        len(layers), _ptr(tab), _ptr(eps), _ptr(x), None, _ptr(res_out), _ptr(out), T, H, attn.num_heads,
        attn.num_kv_heads, attn.head_dim, _ptr(pos), _ptr(cos_sin_cache), cos_sin_cache.shape[0], num_pages, ps,
        _ptr(slots), _ptr(lens), _ptr(bt), bt.stride(0), bt.shape[1], attn.scale, mlp.down_proj.in_features,
        _DT[x.dtype], torch.get_num_threads(), *((None, None) if lora is None else (_ptr(lora[0]), _ptr(lora[1]))))
    if rc == 1:
        raise ValueError("decoder layers: the native attention does not read 1-byte caches at this shape")
    if rc < 0:  # nothing was written
        if rc >= -2 * T:
            raise _rows_error("decoder layers", rc, slots, pos, num_pages * ps, cos_sin_cache.shape[0])
        raise _tables_error("decoder layers", rc + 2 * T, lens, bt, num_pages, ps)
    return out, res_out
