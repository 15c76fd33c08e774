"""Issue rates of the host's dot-product instructions, one thread: AVX512-BF16 ``vdpbf16ps`` (32 bf16 products a
512-bit instruction, what the native GEMVs in ``ops/moe/cpu_experts.c`` run on), AVX512-VNNI ``vpdpbusd`` (64 u8 x s8
products, what a GEMV on 8-bit activations would run on, as llama.cpp's) and fp32 FMA, each over 8 independent
accumulators. Tells whether a host's bf16 dot products or its integer ones are the cheaper way to a GEMV's products.

    python benchmarks/probe_cpu_dot_rates.py [--out benchmarks/results/cpu/sweeps/cpu_dot_rates.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

SRC = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define KEEP(a) __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), \
                                      "+v"(a[6]), "+v"(a[7]))
int main(void) {
    const long n = 50000000;
    for (int rep = 0; rep < 3; rep++) {
        __m512 a[8];
        __m512i c[8];
        for (int i = 0; i < 8; i++) { a[i] = _mm512_set1_ps(i * 1e-9f); c[i] = _mm512_set1_epi32(i); }
        const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
        const __m512 b = _mm512_set1_ps(1e-9f);
        const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
        double t = now();
        for (long i = 0; i < n; i++) {
            for (int j = 0; j < 8; j++) a[j] = _mm512_dpbf16_ps(a[j], x, x);
            KEEP(a);
        }
        const double dp = (now() - t) / n / 8;
        t = now();
        for (long i = 0; i < n; i++) {
            for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(a[j], b, b);
            KEEP(a);
        }
        const double fma = (now() - t) / n / 8;
        t = now();
        for (long i = 0; i < n; i++) {
            for (int j = 0; j < 8; j++) c[j] = _mm512_dpbusd_epi32(c[j], u, s);
            KEEP(c);
        }
        const double vnni = (now() - t) / n / 8;
        float r = 0;
        for (int i = 0; i < 8; i++) r += _mm512_reduce_add_ps(a[i]) + (float)_mm512_reduce_add_epi32(c[i]);
        printf("%.6e %.6e %.6e %g\n", dp, fma, vnni, r);
    }
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cpu_dot_rates.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "rates.c"), os.path.join(d, "rates")
        with open(src, "w") as f:
            f.write(SRC)
        subprocess.run(["gcc", "-O2", "-march=native", "-funroll-loops", src, "-o", exe], check=True)
        rows = [list(map(float, ln.split()[:3])) for ln in subprocess.run(
            [exe], check=True, capture_output=True, text=True).stdout.split("\n") if ln.strip()]
    dp, fma, vnni = (min(r[i] for r in rows) for i in range(3))  # best of 3 rounds, seconds an instruction
    print(f"vdpbf16ps {dp * 1e9:.3f} ns ({32 / dp / 1e9:.1f} G products/s), vpdpbusd {vnni * 1e9:.3f} ns "
          f"({64 / vnni / 1e9:.1f} G products/s), fp32 FMA {fma * 1e9:.3f} ns ({16 / fma / 1e9:.1f} G products/s)")
    cases = [case("one thread, 8 independent 512-bit accumulators", metric="products a second", unit="G/s",
                  ours=32 / dp / 1e9, peers={"vpdpbusd (u8 x s8)": 64 / vnni / 1e9, "fp32 FMA": 16 / fma / 1e9},
                  floor=None, ns_per_instruction={"vdpbf16ps": dp * 1e9, "vpdpbusd": vnni * 1e9, "fma": fma * 1e9})]
    write_results(args.out, "cpu_dot_rates", "cpu", cases)


if __name__ == "__main__":
    main()
