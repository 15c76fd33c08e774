"""bf16 GEMMs of Hopper through CUTLASS 3 (``gemm.cu``), built with ``nvcc`` at first use: a probe's module
(``benchmarks/probe_cutlass_gemm.py``), not the library's. Measured on an H100 against ``F.linear`` on the 8B decode
shapes at 128 / 256 rows, none of these configurations was faster where it matters
(``results/h200/sweeps/probe_cutlass_gemm_h100.json``), so the library keeps cuBLAS.

``y = x @ W^T`` for x ``[M, K]`` and a Linear's weight W ``[N, K]``, bf16 in and out, fp32 accumulation, through
CUTLASS's warp-specialized TMA kernels (cooperative or ping-pong consumers, persistent or stream-K tile schedulers,
thread-block clusters that multicast a weight tile to the CTAs of both M tiles). Each configuration (:data:`CONFIGS`)
is one translation unit, compiled in parallel into one shared library kept in the cache directory
(``$INFERCORE_CACHE``, else ``~/.cache/infercore``) and called through ctypes on torch's current stream, so the calls
are captured into CUDA graphs like any other kernel.

Needs: a CUDA sm90 GPU, ``nvcc`` (``$CUDA_HOME/bin``, ``PATH``, or the ``nvidia-cuda-nvcc`` wheel) and CUTLASS's
headers (``$INFERCORE_CUTLASS_DIR`` = a CUTLASS checkout, or the ``nvidia-cutlass`` wheel, which carries them).
:func:`available` says whether all three are there; callers keep cuBLAS otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("gemm.cu")

# name -> (tile M, tile N, tile K, cluster M, cluster N, ping-pong, stream-K)
CONFIGS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "coop_128x256_c1": (128, 256, 64, 1, 1, 0, 0),
    "coop_128x256_c2": (128, 256, 64, 2, 1, 0, 0),
    "coop_256x128_c1": (256, 128, 64, 1, 1, 0, 0),
    "sk_128x256_c1": (128, 256, 64, 1, 1, 0, 1),
    "sk_128x256_c2": (128, 256, 64, 2, 1, 0, 1),
    "sk_256x128_c1": (256, 128, 64, 1, 1, 0, 1),
    "sk_128x128_c2": (128, 128, 64, 2, 1, 0, 1),
    "pp_128x128_c2": (128, 128, 64, 2, 1, 1, 0),
}

# Stream-K builds' decomposition, per call.
MODES = {"heuristic": 0, "dp": 1, "splitk": 2, "streamk": 3}


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or []) if spec else []
    return Path(locs[0]) if locs else None


def _cutlass_include() -> Path | None:
    env = os.environ.get("INFERCORE_CUTLASS_DIR")
    roots = [Path(env)] if env else []
    pkg = _package_dir("cutlass_library")  # the nvidia-cutlass wheel (not imported: its package pulls in a generator)
    if pkg is not None:
        roots.append(pkg / "source")
    for r in roots:
        inc = r / "include"
        if (inc / "cutlass" / "cutlass.h").exists():
            return inc
    return None


def _nvcc() -> Path | None:
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "bin" / "nvcc")
    w = shutil.which("nvcc")
    if w:
        cands.append(Path(w))
    cands.append(Path("/usr/local/cuda/bin/nvcc"))
    pkg = _package_dir("nvidia.cu13")  # the nvidia-cuda-nvcc wheel (CUDA 13)
    if pkg is not None:
        cands.append(pkg / "bin" / "nvcc")
    return next((c for c in cands if c.is_file() and os.access(c, os.X_OK)), None)


@functools.cache
def available() -> bool:
    """A CUDA sm90 GPU, nvcc and CUTLASS's headers are all there."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    return _nvcc() is not None and _cutlass_include() is not None


def _cache_dir() -> Path:
    cache = Path(os.environ.get("INFERCORE_CACHE") or Path.home() / ".cache" / "infercore")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise OSError(f"{cache} is not writable")
    except OSError:
        cache = Path(tempfile.gettempdir()) / f"infercore-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        cache.mkdir(parents=True, exist_ok=True)
    return cache


def _flags(nvcc: Path, inc: Path) -> list[str]:
    cuda_inc = nvcc.parent.parent / "include"
    flags = ["-std=c++17", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
             "-Xcompiler", "-fPIC", f"-I{inc}", f"-I{inc.parent / 'tools' / 'util' / 'include'}"]
    if (cuda_inc / "cccl").is_dir():  # the pip wheels keep libcu++ / CUB there
        flags.append(f"-I{cuda_inc / 'cccl'}")
    return flags


def _defines(name: str) -> list[str]:
    tm, tn, tk, cm, cn, pp, sk = CONFIGS[name]
    return [f"-DIC_NAME=ic_{name}", f"-DIC_TM={tm}", f"-DIC_TN={tn}", f"-DIC_TK={tk}", f"-DIC_CM={cm}",
            f"-DIC_CN={cn}", f"-DIC_PINGPONG={pp}", f"-DIC_STREAMK={sk}"]


@functools.cache
def _lib(names: tuple[str, ...]) -> ctypes.CDLL:
    nvcc, inc = _nvcc(), _cutlass_include()
    if nvcc is None or inc is None:
        raise RuntimeError("CUTLASS GEMMs need nvcc and CUTLASS's headers (pip install nvidia-cutlass)")
    flags = _flags(nvcc, inc)
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False).stdout
    cutlass_version = (inc / "cutlass" / "version.h").read_bytes() if (inc / "cutlass" / "version.h").exists() else b""
    key = hashlib.sha256(_SRC.read_bytes() + cutlass_version + version.encode() + " ".join(flags).encode()
                         + repr([(n, CONFIGS[n]) for n in names]).encode()).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"cutlass_sm90_{key}.so"
    if not lib.exists():
        tmpdir = Path(tempfile.mkdtemp(dir=cache))
        try:
            procs = []
            jobs = max(1, min(len(names), os.cpu_count() or 1))
            objs = []
            for i, n in enumerate(names):
                obj = tmpdir / f"{n}.o"
                objs.append(obj)
                cmd = [str(nvcc), *flags, *_defines(n), "-c", str(_SRC), "-o", str(obj)]
                procs.append((n, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
                if len(procs) >= jobs or i == len(names) - 1:
                    for pn, p in procs:
                        out = p.communicate()[0].decode(errors="replace")
                        if p.returncode:
                            raise RuntimeError(f"nvcc failed on CUTLASS config {pn}: {out[-3000:]}")
                    procs = []
            so = tmpdir / "lib.so"
            libdirs = [f"-L{d}" for d in (nvcc.parent.parent / "lib64", nvcc.parent.parent / "lib") if d.is_dir()]
            cmd = [str(nvcc), "-shared", "-gencode=arch=compute_90a,code=sm_90a", *libdirs, *map(str, objs), "-o",
                   str(so)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode:
                raise RuntimeError(f"nvcc link failed: {r.stderr[-3000:]}")
            os.replace(so, lib)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    dll = ctypes.CDLL(str(lib))
    P, I, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for n in names:
        ws = getattr(dll, f"ic_{n}_workspace")
        ws.argtypes, ws.restype = [I, I, I, I, I, I], Z
        run = getattr(dll, f"ic_{n}_run")
        run.argtypes, run.restype = [P, P, P, I, I, I, I, I, I, I, I, P, Z, I, P], I
    return dll


def build(names: tuple[str, ...] | None = None) -> None:
    """Compile (or load from the cache) the given configurations (default: all)."""
    _lib(tuple(sorted(names or CONFIGS)))


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_ERRORS = {1: "the shape or alignment is not supported", 2: "the workspace is too small",
           3: "initialize failed", 4: "the launch failed"}


def gemm(x: torch.Tensor, weight: torch.Tensor, *, config: str, mode: str = "heuristic", splits: int = 1,
         out: torch.Tensor | None = None, names: tuple[str, ...] | None = None) -> torch.Tensor:
    """``x @ weight.T`` through CUTLASS configuration ``config``; x ``[M, K]`` / weight ``[N, K]`` bf16 CUDA tensors
    with unit stride along K and 16-byte aligned rows. ``names``: the configurations built together (one library)."""
    if config not in CONFIGS:
        raise ValueError(f"config: expected one of {sorted(CONFIGS)}, got {config!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    for nm, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise TypeError(f"{nm}: expected a 2-D tensor")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{nm}: expected bfloat16, got {t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{nm}: expected a CUDA tensor")
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            raise ValueError(f"{nm}: rows must be contiguous and 16-byte aligned")
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise ValueError(f"weight: expected K = {k} columns, got {kw}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.stride(0) % 8:
        raise ValueError("out: expected a bf16 [M, N] tensor with contiguous, 16-byte aligned rows")
    dll = _lib(tuple(sorted(names or CONFIGS)))
    sms = _sms(x.device.index or 0)
    md = MODES[mode]
    wsize = getattr(dll, f"ic_{config}_workspace")(m, n, k, md, splits, sms)
    ws = torch.empty(max(wsize, 1), dtype=torch.uint8, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = getattr(dll, f"ic_{config}_run")(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, x.stride(0),
                                          weight.stride(0), out.stride(0), md, splits, ws.data_ptr(), wsize, sms,
                                          stream)
    if rc:
        raise RuntimeError(f"CUTLASS GEMM {config} ({m}x{n}x{k}, {mode}): {_ERRORS.get(rc, rc)}")
    return out
