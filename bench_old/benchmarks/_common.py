"""Shared helpers of the benchmark scripts: timing, measured ceilings, and the results JSON.

The JSON layout is the one in CONVENTIONS.md::

    {"name", "device", "date", "command", "env": {torch, triton, gpu},
     "cases": [{"case", "metric", "unit", "ours", "peers": {name: value}, "floor",
                "ours_over_floor", "ours_vs_best_peer", ...extra keys}]}

Every metric is higher-is-better (TB/s, TFLOP/s, tok/s), so every ratio reads the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def bench_ms(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (CUDA events through ``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_graph(calls: Callable[[int], Any], n_calls: int, reps: int = 10, warmup: int = 2) -> float:
    """Seconds per call: ``calls(i)`` for i in ``range(n_calls)`` captured in one CUDA graph, timed
    over ``reps`` replays (median) after ``warmup`` untimed ones. For kernels of a few microseconds,
    where launch gaps would hide the kernel: ``calls(i)`` can rotate over weight copies whose total
    exceeds the L2 so that every call reads its weights from HBM."""
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            calls(i)
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del g
    times.sort()
    return times[len(times) // 2] / n_calls


def alternating_rounds(timed: dict[str, tuple[Callable[[int], Any], int]], rounds: int,
                       rows: list[dict[str, Any]], case_name: str) -> dict[str, float]:
    """Microseconds per call of each ``timed`` entry (``label: (calls, n_calls)``, see :func:`time_graph`), the
    median of ``rounds`` rounds that each time every entry once (so drift hits all alike); an entry whose timing
    fails reads nan. Appends one row per entry, fastest first, ``{case, config, us, rounds_us}`` to ``rows``."""
    import statistics

    times: dict[str, list[float]] = {lab: [] for lab in timed}
    for _ in range(rounds):
        for lab, (call, nc) in timed.items():
            try:
                times[lab].append(time_graph(call, nc, reps=5, warmup=1) * 1e6)
            except Exception as e:  # noqa: BLE001
                print(f"  {case_name} {lab}: timing FAILED {repr(e)[:300]}", flush=True)
                times[lab].append(float("nan"))
    med = {lab: statistics.median(v) for lab, v in times.items()}
    for lab, us in sorted(med.items(), key=lambda kv: kv[1]):
        rows.append({"case": case_name, "config": lab, "us": us, "rounds_us": times[lab]})
    return med


def within_budget(items: Iterable[Any], budget_s: float, start: float) -> Iterator[Any]:
    """``items`` one by one until ``budget_s`` seconds have passed since ``start`` (a ``time.perf_counter()``
    reading); then prints "budget reached" and stops, so a device call ends with what it measured."""
    import time

    for item in items:
        if time.perf_counter() - start > budget_s:
            print("budget reached", flush=True)
            return
        yield item


def best_of(fn: Callable[[], Any], reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls of ``fn`` after one warm-up call (host-side wall clock)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Seconds of the fastest call of each of ``fns`` (host-side wall clock) over ``rounds`` rounds that each call
    every entry once, after one warm-up call each: a drift of a shared machine hits them alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t)
    return best


def engine_decode_rate(eng, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Greedy batch-1 decode tokens/s of ``eng`` (an ``infercore.Engine``) after ``prompt`` (token ids): ``new - 1``
    tokens over the time of prompt + ``new`` tokens less that of prompt + 1 token (the prefill); and the tokens."""
    from infercore import SamplingParams

    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    t_pre = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
    t_all = time.perf_counter() - t0
    return (new - 1) / max(t_all - t_pre, 1e-9), out.token_ids


def eager_us(call: Callable[[], Any], n: int = 300, warmup: int = 20) -> float:
    """Microseconds per ``call()`` run back to back without a CUDA graph (after ``warmup`` calls): for
    small kernels this is the host's dispatch and launch time, not the GPU's."""
    import time

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def log_triton_compiles(sink: list[dict[str, Any]]) -> None:
    """Append every Triton JIT compile from now on to ``sink``: ``{"at": perf_counter, "kernel": name,
    "repr": the kernel's argument types and specializations, "key": Triton's cache key}``. A compile
    inside a timed run is a new specialization (an integer argument that became divisible by 16, a new
    constexpr) that the warm-up did not cover."""
    import time

    import triton

    def hook(*, key, repr, **kw):
        sink.append({"at": time.perf_counter(), "kernel": repr.split("[", 1)[0], "repr": repr, "key": str(key)})
        return False

    triton.knobs.runtime.jit_cache_hook = hook


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref|| / ||ref||`` in fp32 (``ref`` fp32 or wider)."""
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.random_(0, 255)
    b = torch.empty_like(a)
    t = bench_ms(lambda: b.copy_(a))
    return 2 * nbytes / (t * 1e-3)


def host_read_bandwidth(nbytes: int = 1 << 31) -> float:
    """Bytes/s of a read over a host buffer with every thread (what host GEMVs are bound by), best of 5: the faster
    of torch's ``sum`` and the native read pass (``ops.moe.cpu_native.read_bandwidth``, AVX-512 loads; torch's
    fp32 ``sum`` reads slower than the native GEMVs on a 2-core EPYC)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    bw = nbytes / best
    from infercore.ops.moe import cpu_native

    if cpu_native.available():
        bw = max(bw, cpu_native.read_bandwidth(nbytes, repeats=10))
    return bw


def matmul_flops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured dense matmul rate (FLOP/s) on random data, the compute ceiling."""
    x = torch.randn(n, n, device=device, dtype=dtype)
    y = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (bench_ms(lambda: x @ y) * 1e-3)


def case(
    name: str,
    *,
    metric: str,
    unit: str,
    ours: float,
    peers: dict[str, float],
    floor: float | None,
    **extra: Any,
) -> dict[str, Any]:
    """One result row; ``floor`` is the physical ceiling in the same unit (None if not meaningful)."""
    best = max(peers.values()) if peers else None
    row = {
        "case": name,
        "metric": metric,
        "unit": unit,
        "ours": ours,
        "peers": peers,
        "floor": floor,
        "ours_over_floor": (ours / floor) if floor else None,
        "ours_vs_best_peer": (ours / best) if best else None,
    }
    row.update(extra)
    return row


def env_info() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    # The host CPU: the machines lent for CPU runs differ (a 2-core AMD EPYC until 2026-12-05, then an Intel Xeon)
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    # Switches that change what runs (INFERCORE_PDL, INFERCORE_DECODE_FUSED_MERGE, ...) are part of the result.
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("INFERCORE_")}
    return {"torch": torch.__version__, "triton": triton_version, "gpu": gpu, "cpu": f"{cpu} x{os.cpu_count()}",
            **switches}


def write_results(path: str, name: str, device: str, cases: list[dict[str, Any]],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the results JSON to ``path`` (directories created) and return it; ``extra``: further top-level keys
    (a script's raw rows, best configs, measured ceilings)."""
    doc = {
        "name": name,
        "device": device,
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "env": env_info(),
        "cases": cases,
        **(extra or {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc
