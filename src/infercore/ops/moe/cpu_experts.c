/* Routed experts of a sparse MoE layer on the host CPU, bf16 weights in their plain layout, in one call.
 *
 * Built at first use by infercore/ops/moe/cpu_native.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes. One OpenMP region per layer: the gate_up GEMVs of every routed (expert, token) pair, split into
 * blocks of RB weight rows across the threads; SiLU-and-mul; the down GEMVs the same way; and the weighted sum
 * into each token's row. A decode token reads each routed expert's weights once, streamed by every core, with
 * no per-expert call, packing or allocation.
 *
 * Rounding follows ops.moe.naive.moe_experts_loop: each GEMV's output rounded to bf16, SiLU-and-mul in fp32
 * rounded once, each pair's output scaled in fp32 and rounded to bf16, a token's pairs summed in fp32 and
 * rounded once. The dot products accumulate in fp32 in another order than oneDNN's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define RB 16   /* weight rows per work unit */
#define MB 4    /* token rows per pass over a unit's weights */
#define HC 256  /* output columns per unit of the final sum */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* y[m] = sum_k x[m][k] * w[k] for m < M (M <= MB), x rows of stride ldx, all bf16, sums in fp32 */
static void dot_rows(const uint16_t *w, const uint16_t *const *x, int M, int64_t K, float *y) {
#if defined(__AVX512BF16__)
    __m512 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(x[m] + k)), (__m512bh)wv);
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv = _mm512_maskz_loadu_epi16(mask, w + k);
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k), (__m512bh)wv);
    }
    for (int m = 0; m < M; m++) y[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX512F__)
    __m512 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k))), 16));
        for (int m = 0; m < M; m++) {
            __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x[m] + k))), 16));
            acc[m] = _mm512_fmadd_ps(xv, wv, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float s = _mm512_reduce_add_ps(acc[m]);
        for (int64_t j = k; j < K; j++) s += bf16_to_f32(x[m][j]) * bf16_to_f32(w[j]);
        y[m] = s;
    }
#else
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        for (int64_t j = 0; j < K; j++) s += bf16_to_f32(x[m][j]) * bf16_to_f32(w[j]);
        y[m] = s;
    }
#endif
}

/* One unit: rows [r0, r1) of the weight w [N, K] against the n rows of xs (pointers), out rows of stride ldo */
static void unit_gemv(const uint16_t *w, int64_t K, int64_t r0, int64_t r1, const uint16_t *const *xs, int n,
                      uint16_t *out, int64_t ldo) {
    float y[MB];
    for (int c = 0; c < n; c += MB) {
        int M = n - c < MB ? n - c : MB;
        for (int64_t r = r0; r < r1; r++) {
            dot_rows(w + r * K, xs + c, M, K, y);
            for (int m = 0; m < M; m++) out[(int64_t)(c + m) * ldo + r] = f32_to_bf16(y[m]);
        }
    }
}

/*
 * x [T, H] bf16; gate_up [E, 2I, H], down [E, H, I] bf16, contiguous.
 * G groups: group g is expert gexp[g] over pairs [goff[g], goff[g + 1]) of the P pairs; pair p is token
 * ptok[p] with weight pw[p] (fp32). Workspaces: h [P, 2I], act [P, I], y [P, H] (bf16), acc [T, H] (fp32).
 * out [T, H] bf16 (every row written; tokens with no pair get zeros).
 */
void infercore_moe_experts_bf16(const uint16_t *x, int64_t T, int64_t H, int64_t I, const uint16_t *gate_up,
                                const uint16_t *down, int64_t G, const int64_t *gexp, const int64_t *goff,
                                const int64_t *ptok, const float *pw, uint16_t *h, uint16_t *act, uint16_t *y,
                                float *acc, uint16_t *out, int nthreads) {
    const int64_t P = goff[G];
    const int64_t I2 = 2 * I;
    const int64_t nb1 = (I2 + RB - 1) / RB, nb2 = (H + RB - 1) / RB;
#pragma omp parallel num_threads(nthreads)
    {
        const uint16_t *xs[MB];
        /* gate_up: units (group, row block) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < G * nb1; u++) {
            int64_t g = u / nb1, b = u % nb1;
            const uint16_t *w = gate_up + gexp[g] * I2 * H;
            int64_t p0 = goff[g], n = goff[g + 1] - p0;
            for (int64_t c = 0; c < n; c += MB) {
                int M = n - c < MB ? (int)(n - c) : MB;
                for (int m = 0; m < M; m++) xs[m] = x + ptok[p0 + c + m] * H;
                unit_gemv(w, H, b * RB, (b + 1) * RB < I2 ? (b + 1) * RB : I2, xs, M, h + (p0 + c) * I2, I2);
            }
        }
        /* SiLU-and-mul, fp32 from the rounded gate_up outputs */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const uint16_t *hp = h + p * I2;
            uint16_t *ap = act + p * I;
            for (int64_t i = 0; i < I; i++) {
                float gt = bf16_to_f32(hp[i]), up = bf16_to_f32(hp[I + i]);
                ap[i] = f32_to_bf16(gt / (1.f + expf(-gt)) * up);
            }
        }
        /* down: units (group, row block) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < G * nb2; u++) {
            int64_t g = u / nb2, b = u % nb2;
            const uint16_t *w = down + gexp[g] * H * I;
            int64_t p0 = goff[g], n = goff[g + 1] - p0;
            for (int64_t c = 0; c < n; c += MB) {
                int M = n - c < MB ? (int)(n - c) : MB;
                for (int m = 0; m < M; m++) xs[m] = act + (p0 + c + m) * I;
                unit_gemv(w, I, b * RB, (b + 1) * RB < H ? (b + 1) * RB : H, xs, M, y + (p0 + c) * H, H);
            }
        }
        /* the weighted sum, pairs in their given order, by column blocks */
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < H; c0 += HC) {
            int64_t c1 = c0 + HC < H ? c0 + HC : H;
            for (int64_t t = 0; t < T; t++) memset(acc + t * H + c0, 0, (size_t)(c1 - c0) * sizeof(float));
            for (int64_t p = 0; p < P; p++) {
                float *a = acc + ptok[p] * H;
                const uint16_t *yp = y + p * H;
                float wp = pw[p];
                for (int64_t j = c0; j < c1; j++) a[j] += bf16_to_f32(f32_to_bf16(bf16_to_f32(yp[j]) * wp));
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = c0; j < c1; j++) out[t * H + j] = f32_to_bf16(acc[t * H + j]);
        }
    }
}

/* y [M, N] = x [M, K] @ w[N, K]^T, bf16, rows of w in blocks of RB across the threads (a dense decode GEMV) */
void infercore_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, uint16_t *y,
                           int nthreads) {
    const int64_t nb = (N + RB - 1) / RB;
#pragma omp parallel num_threads(nthreads)
    {
        const uint16_t *xs[MB];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t c = 0; c < M; c += MB) {
                int m = M - c < MB ? (int)(M - c) : MB;
                for (int j = 0; j < m; j++) xs[j] = x + (c + j) * K;
                unit_gemv(w, K, b * RB, (b + 1) * RB < N ? (b + 1) * RB : N, xs, m, y + c * N, N);
            }
        }
    }
}

/* A read-only pass over n bytes (n a multiple of 64) by every thread: what the host's weight reads can reach */
uint64_t infercore_read_pass(const uint8_t *p, int64_t n, int nthreads) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(nthreads) reduction(+ : total) schedule(static)
    for (int64_t i = 0; i < n / 4096; i++) {
#if defined(__AVX512F__)
        const __m512i *q = (const __m512i *)(p + i * 4096);
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < 64; j += 4) {
            a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(q + j));
            a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(q + j + 1));
            a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(q + j + 2));
            a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(q + j + 3));
        }
        total += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#else
        const uint64_t *q = (const uint64_t *)(p + i * 4096);
        for (int j = 0; j < 512; j++) total += q[j];
#endif
    }
    return total;
}

int infercore_native_isa(void) { /* 2: AVX512-BF16, 1: AVX512F, 0: scalar */
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
