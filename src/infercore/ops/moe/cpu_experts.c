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
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "../cpu_bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define RB 16   /* weight rows per work unit */
#define MB 4    /* token rows per pass over a unit's weights */
#define HC 256  /* output columns per unit of the final sum */


#if defined(__AVX512BF16__)
static inline __m512 dp_at(__m512 acc, const uint16_t *x, const uint16_t *w, int64_t k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                            (__m512bh)_mm512_loadu_si512((const void *)(w + k)));
}
#endif

/* y[m] = sum_k x[m][k] * w[k] for m < M (M <= MB), x rows of stride ldx, all bf16, sums in fp32 */
static void dot_rows(const uint16_t *w, const uint16_t *const *x, int M, int64_t K, float *y) {
#if defined(__AVX512BF16__)
    if (M == 1) { /* one token: four independent accumulator chains over K, so the loads are not waiting on adds */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const uint16_t *x0 = x[0];
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            a0 = dp_at(a0, x0, w, k);
            a1 = dp_at(a1, x0, w, k + 32);
            a2 = dp_at(a2, x0, w, k + 64);
            a3 = dp_at(a3, x0, w, k + 96);
        }
        for (; k + 32 <= K; k += 32) a0 = dp_at(a0, x0, w, k);
        if (k < K) {
            __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, x0 + k),
                                  (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k));
        }
        y[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
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

/* INT4 rows in groups of g along K (g in 32, 64, 128, 256). Codes of one row: K / 2 bytes, each span of 64 elements
 * in 32 bytes, byte b holding element b of the span in its low nibble and element 32 + b in its high one; where
 * g = 32 and K % 64 = 32, the last 32 elements in 16 bytes, byte b holding elements b and 16 + b (GGUF's block
 * layout). sz: scales [K / g] then zeros [K / g] (fp32) with w = (128 + q) * scale + zero: each code is read as
 * the bf16 of 128 + q (0x4300 | q, exact), so group j adds scale_j * sum_i (128 + q_i) x_i + zero_j * xsum_j
 * (xsum: the row's group sums, group_sums). ops/moe/cpu_native.py's _q4_operands packs both. */
#define Q4G 128 /* the MoE experts' group */
static inline int q4_code(const uint8_t *c, int64_t K, int64_t e) {
    const int64_t k64 = K / 64 * 64;
    if (e >= k64) { /* the 32-element tail */
        const int64_t i = e - k64;
        return i < 16 ? c[k64 / 2 + i] & 15 : c[k64 / 2 + i - 16] >> 4;
    }
    const int64_t i = e % 64;
    return i < 32 ? c[e / 64 * 32 + i] & 15 : c[e / 64 * 32 + i - 32] >> 4;
}

#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
/* The quantized rows without AVX512-BF16: group j of row m adds scale_j * sum_i c_i x_i + zero'_j * xsum_j, c_i the
 * value the vector kernels read for code i: 128 + q (INT4, q8 = 0; Q5, q5 = 1: q with its fifth bit) or u + 2176
 * (INT8, q8 = 1, see dot_q8_m; codes below 128, q8 = 2: u + 128) */
static void dot_rows_scalar(const uint8_t *codes, const float *sz, const uint16_t *const *x, const float *const *xsum,
                            int M, int64_t K, int64_t g, int q8, int q5, float *y) {
    const int64_t nG = K / g;
    const uint32_t *hb = (const uint32_t *)(sz + 2 * nG);
    for (int m = 0; m < M; m++) {
        float t = 0.f;
        for (int64_t j = 0; j < nG; j++) {
            float a = 0.f;
            for (int64_t i = j * g; i < (j + 1) * g; i++)
                a += (float)(q8 ? codes[i] + (q8 == 2 ? 128 : 2176)
                                : 128 + q4_code(codes, K, i) + (q5 ? 16 * (int)((hb[i / 32] >> (i % 32)) & 1) : 0)) *
                     bf16_to_f32(x[m][i]);
            t += a * sz[j] + xsum[m][j] * sz[nG + j];
        }
        y[m] = t;
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) __m512 dp0(const uint16_t *x, __m512i w) {
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512((const void *)x), (__m512bh)w);
}

static inline __attribute__((always_inline)) void dot_q4_g(const uint8_t *codes, const float *sz,
                                                           const uint16_t *const *x, const float *const *xsum,
                                                           const int M, int64_t K, const int64_t g, const int q5,
                                                           float *y) {
    const int64_t nG = K / g, k64 = K / 64 * 64;
    const float *scale = sz, *zero = sz + nG;
    /* q5 (g = 32): a third plane of sz holds each group's fifth bits, bit i of word j that of element 32 j + i; the
     * bf16 of 128 + q takes it as bit 4 of the mantissa (0x4300 | q, q < 32: exact) */
    const uint32_t *hb = (const uint32_t *)(sz + 2 * nG);
    const __m512i lo4 = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300), b4 = _mm512_set1_epi16(0x10);
    /* two chains a row: the low halves of the spans in t0, the high ones in t1 */
    __m512 t0[MB], t1[MB];
    for (int m = 0; m < M; m++) t0[m] = t1[m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < k64 / 64; s++) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * s)));
        __m512i wl = _mm512_or_si512(_mm512_and_si512(v, lo4), bias);
        __m512i wh = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
        if (q5) {
            wl = _mm512_or_si512(wl, _mm512_maskz_mov_epi16((__mmask32)hb[2 * s], b4));
            wh = _mm512_or_si512(wh, _mm512_maskz_mov_epi16((__mmask32)hb[2 * s + 1], b4));
        }
        /* g = 32: the halves are groups 2s and 2s + 1; else both in group 64 s / g */
        const __m512 s0 = _mm512_set1_ps(scale[g == 32 ? 2 * s : 64 * s / g]);
        const __m512 s1 = g == 32 ? _mm512_set1_ps(scale[2 * s + 1]) : s0;
        for (int m = 0; m < M; m++) {
            const uint16_t *xs = x[m] + 64 * s;
            t0[m] = _mm512_fmadd_ps(dp0(xs, wl), s0, t0[m]);
            t1[m] = _mm512_fmadd_ps(dp0(xs + 32, wh), s1, t1[m]);
        }
    }
    if (k64 < K) { /* g = 32: the last group in 16 bytes */
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + k64 / 2)));
        const __m256i l4 = _mm256_set1_epi16(0x0f);
        __m512i w = _mm512_or_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, l4)),
                                                       _mm256_srli_epi16(v, 4), 1), bias);
        if (q5) w = _mm512_or_si512(w, _mm512_maskz_mov_epi16((__mmask32)hb[nG - 1], b4));
        const __m512 sl = _mm512_set1_ps(scale[nG - 1]);
        for (int m = 0; m < M; m++) t0[m] = _mm512_fmadd_ps(dp0(x[m] + k64, w), sl, t0[m]);
    }
    for (int m = 0; m < M; m++) {
        __m512 z = _mm512_add_ps(t0[m], t1[m]);
        for (int64_t j = 0; j < nG; j += 16) {
            const __mmask16 k = nG - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nG - j)) - 1);
            z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, zero + j), _mm512_maskz_loadu_ps(k, xsum[m] + j), z);
        }
        y[m] = _mm512_reduce_add_ps(z);
    }
}
#endif

#define KF ((int64_t)1 << 20) /* an entry point's g | KF: sz in the two-level form (expand_kform) */
#define A8F ((int64_t)1 << 21) /* an INT4 / INT8 entry point's g | A8F: 8-bit activations (infercore_act_prep) */

/* 8-bit activations (opt-in, infercore_set_a8): a token row of K in blocks of 32, x_i ~ dx_b * xq_i with dx_b =
 * max |x| / 127 over the block and xq_i = round(x_i / dx_b) (nearest even; 0 where the block is all zeros). A row's
 * activation data (infercore_act_prep), act_floats(K, g, 1) floats: the exact group sums [K / g] (bf16 x, for the
 * zeros), then dxv [K / 4]: per span of 64 the 16 lanes' dx (lanes 0-7 the span's first block, 8-15 its second; a
 * 32-element tail's 8 lanes its one block), then xq [K] (int8). INT4 rows then take, per span, one u8 x s8 dot
 * product instruction (vpdpbusd) over the codes q in [0, 16) for 64 weights: sum_i w_i x_i ~ sum_j scale_j
 * sum_b dx_b sum_i q_i xq_i + (zero'_j + 128 scale_j) xsum_j, exact integer products, fp32 sums. */
static inline int64_t act_floats(int64_t K, int64_t g, int a8) { return K / g + (a8 ? K / 2 : 0); }

/* sums[j] = sum of x over group j of g (the zero term of INT4 rows), a row of K */
static void group_sums(const uint16_t *x, int64_t K, int64_t g, float *sums) {
    for (int64_t j = 0; j < K / g; j++) {
        float s = 0.f;
        for (int64_t i = 0; i < g; i++) s += bf16_to_f32(x[j * g + i]);
        sums[j] = s;
    }
}

static void act_prep_row(const uint16_t *x, int64_t K, int64_t g, int a8, float *out) {
    group_sums(x, K, g, out);
    if (!a8) return;
    float *dxv = out + K / g;
    int8_t *xq = (int8_t *)(dxv + K / 4);
    for (int64_t b = 0; b < K / 32; b++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(bf16_to_f32(x[32 * b + i])));
        const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < 32; i++) {
            const float q = nearbyintf(bf16_to_f32(x[32 * b + i]) * inv);
            xq[32 * b + i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
        }
        /* block b: lanes 8 (b % 2) .. + 7 of span b / 2; a tail block (K % 64 = 32) fills its span's lanes 0-7 */
        for (int l = 0; l < 8; l++) dxv[16 * (b / 2) + 8 * (b % 2) + l] = dx;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_A8 1
/* Zeroed accumulators t and each token row's dx lanes and int8 row (act_prep_row's layout after nG group sums) */
static inline __attribute__((always_inline)) void a8_start(const float *const *act, const int M, int64_t K,
                                                           int64_t nG, __m512 *t, const float **dxv,
                                                           const int8_t **xq) {
    for (int m = 0; m < M; m++) {
        t[m] = _mm512_setzero_ps();
        dxv[m] = act[m] + nG;
        xq[m] = (const int8_t *)(dxv[m] + K / 4);
    }
}

/* y[m] = the lanes of t[m] plus the zeros' term: sum_j (zero'_j + bias scale_j) xsum_j (xsum: act[m], exact) */
static inline __attribute__((always_inline)) void a8_finish(const __m512 *t, const float *const *act,
                                                            const float *scale, const float *zero, int64_t nG,
                                                            float bias, const int M, float *y) {
    const __m512 b = _mm512_set1_ps(bias);
    for (int m = 0; m < M; m++) {
        __m512 z = t[m];
        for (int64_t j = 0; j < nG; j += 16) {
            const __mmask16 k = nG - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nG - j)) - 1);
            const __m512 zj = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(k, scale + j), _mm512_maskz_loadu_ps(k, zero + j));
            z = _mm512_fmadd_ps(zj, _mm512_maskz_loadu_ps(k, act[m] + j), z);
        }
        y[m] = _mm512_reduce_add_ps(z);
    }
}

static inline __attribute__((always_inline)) void dot_q4a8_g(const uint8_t *codes, const float *sz,
                                                             const float *const *act, const int M, int64_t K,
                                                             const int64_t g, float *y) {
    const int64_t nG = K / g, k64 = K / 64 * 64;
    const float *scale = sz, *zero = sz + nG;
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    __m512 t[MB];
    const float *dxv[MB];
    const int8_t *xq[MB];
    a8_start(act, M, K, nG, t, dxv, xq);
    for (int64_t s = 0; s < k64 / 64; s++) {
        /* bytes 0-31: the span's elements 0-31 (low nibbles), 32-63: elements 32-63 (high nibbles) */
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(codes + 32 * s)));
        const __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(v, (__mmask32)0xffff0000u, v, 4), lo4);
        const __m512 sc = g == 32 ? _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(scale[2 * s]),
                                                         _mm512_set1_ps(scale[2 * s + 1]))
                                  : _mm512_set1_ps(scale[64 * s / g]);
        for (int m = 0; m < M; m++) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xq[m] + 64 * s));
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(dxv[m] + 16 * s));
            t[m] = _mm512_fmadd_ps(f, sc, t[m]);
        }
    }
    if (k64 < K) { /* g = 32: the last group in 16 bytes, byte b holding elements b and 16 + b */
        const __m128i v = _mm_loadu_si128((const __m128i *)(codes + k64 / 2)), l4 = _mm_set1_epi8(0x0f);
        const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, l4)),
                                                  _mm_and_si128(_mm_srli_epi16(v, 4), l4), 1);
        for (int m = 0; m < M; m++) {
            const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q,
                                                  _mm256_loadu_si256((const __m256i *)(xq[m] + k64)));
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(dxv[m] + 16 * (k64 / 64)));
            t[m] = _mm512_add_ps(t[m], _mm512_castps256_ps512(_mm256_mul_ps(f, _mm256_set1_ps(scale[nG - 1]))));
        }
    }
    a8_finish(t, act, scale, zero, nG, 128.f, M, y);
}
#else
#define HAVE_A8 0
#endif

/* 8-bit activations for the INT4 / INT8 GEMVs: 0 off (the default), 1 on where the host has AVX512-VNNI */
static int a8_on = 0;
int infercore_set_a8(int on) {
    a8_on = on && HAVE_A8;
    return a8_on;
}
int infercore_a8_active(void) { return a8_on; }

/* The rows of M tokens' activation data (act_prep_row), each act_floats(K, g, a8) floats */
void infercore_act_prep(const uint16_t *x, int64_t M, int64_t K, int64_t g, int a8, float *out) {
    for (int64_t r = 0; r < M; r++) act_prep_row(x + r * K, K, g, a8, out + r * act_floats(K, g, a8));
}

/* A row's sz in the two-level form of the GGUF K-quants, [D nS][Z nS] fp32 then [sc nG][m nG] int8 (nS = K / 256
 * super-blocks of S = 256 / g groups; K a multiple of 256), as the plain form [scale nG][zero' nG]: scale_j = D_b
 * sc_j, zero' = Z_b m_j - bias scale_j (b = j / S; bias 128 for the INT4 kernels, 2176 for the INT8 ones). The
 * products are exact in fp32 and the difference rounds once, so the values equal the plain form made from the same
 * scales and zeros in one step. */
static void expand_kform(const float *kz, int64_t K, int64_t g, float bias, float *out) {
    const int64_t nG = K / g, nS = K / 256, S = 256 / g;
    const float *D = kz, *Z = kz + nS;
    const int8_t *sc = (const int8_t *)(kz + 2 * nS), *m = sc + nG;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 bv = _mm512_set1_ps(bias);
    for (int64_t j = 0; j < nG; j += 16) {
        const __mmask16 k = nG - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nG - j)) - 1);
        const int64_t b = j / S, b2 = (j + 8) / S < nS ? (j + 8) / S : b; /* S = 8: lanes 8-15 in the next block */
        const __m512 d = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(D[b]), _mm512_set1_ps(D[b2]));
        const __m512 z = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(Z[b]), _mm512_set1_ps(Z[b2]));
        const __m512 sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, sc + j))));
        const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, m + j)));
        _mm512_mask_storeu_ps(out + j, k, sv);
        _mm512_mask_storeu_ps(out + nG + j, k, _mm512_sub_ps(_mm512_mul_ps(z, mv), _mm512_mul_ps(bv, sv)));
    }
#else
    for (int64_t j = 0; j < nG; j++) {
        const float sj = D[j / S] * (float)sc[j];
        out[j] = sj;
        out[nG + j] = Z[j / S] * (float)m[j] - bias * sj;
    }
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* One token against one INT4 row (g a constant once inlined): dot_q4_g for M = 1, inlined into the caller's row loop
 * (its own copy, the accumulators in registers) */
static inline __attribute__((always_inline)) float dot_q4_row(const uint8_t *codes, const float *sz,
                                                              const uint16_t *x, const float *xsum, int64_t K,
                                                              const int64_t g, const int q5) {
    float y;
    dot_q4_g(codes, sz, &x, &xsum, 1, K, g, q5, &y);
    return y;
}

static void dot_rows_q4(const uint8_t *codes, const float *sz, const uint16_t *const *x, const float *const *xsum,
                        int M, int64_t K, int64_t g, int q5, int a8, float *y);

/* One token against rows [r0, r1) of an INT4 weight (rows of K), the results rounded to bf16. One row a pass: four
 * a pass (the token's loads shared) read weights larger than the cache at half the rate. */
static void q4_token_rows(const uint8_t *codes, const float *sz, int64_t g, int q5, int kf, int a8,
                          const uint16_t *x, const float *xsum, int64_t K, int64_t r0, int64_t r1, uint16_t *out) {
    const int64_t cs = K / 2, ss = kf ? 2 * (K / 256) + K / 64 : (q5 ? 3 : 2) * (K / g);
#if HAVE_A8
    if (a8) { /* 8-bit activations (xsum: the row's activation data) */
        float plain[kf ? 2 * (K / 32) : 1], y;
        for (int64_t r = r0; r < r1; r++) {
            const float *rs = sz + r * ss;
            if (kf) {
                expand_kform(rs, K, 32, 128.f, plain);
                rs = plain;
            }
            dot_rows_q4(codes + r * cs, rs, &x, &xsum, 1, K, g, 0, 1, &y);
            out[r] = f32_to_bf16(y);
        }
        return;
    }
#else
    (void)a8;
#endif
    if (kf) { /* the two-level form (groups of 32): each row's plain scales and zeros first */
        float plain[2 * (K / 32)];
        for (int64_t r = r0; r < r1; r++) {
            expand_kform(sz + r * ss, K, 32, 128.f, plain);
            out[r] = f32_to_bf16(dot_q4_row(codes + r * cs, plain, x, xsum, K, 32, 0));
        }
        return;
    }
    if (q5) { /* groups of 32 */
        for (int64_t r = r0; r < r1; r++)
            out[r] = f32_to_bf16(dot_q4_row(codes + r * cs, sz + r * ss, x, xsum, K, 32, 1));
        return;
    }
#define Q4_ROWS(G)                                                                                                   \
    for (int64_t r = r0; r < r1; r++)                                                                                \
        out[r] = f32_to_bf16(dot_q4_row(codes + r * cs, sz + r * ss, x, xsum, K, G, 0));                            \
    break;
    switch (g) {
    case 32: Q4_ROWS(32)
    case 64: Q4_ROWS(64)
    case 128: Q4_ROWS(128)
    default: Q4_ROWS(256)
    }
#undef Q4_ROWS
}
#endif

static void dot_rows_q4(const uint8_t *codes, const float *sz, const uint16_t *const *x, const float *const *xsum,
                        int M, int64_t K, int64_t g, int q5, int a8, float *y) {
#if HAVE_A8
#define A8_M(G)                                                                                                      \
    switch (M) {                                                                                                     \
    case 1: dot_q4a8_g(codes, sz, xsum, 1, K, G, y); return;                                                         \
    case 2: dot_q4a8_g(codes, sz, xsum, 2, K, G, y); return;                                                         \
    case 3: dot_q4a8_g(codes, sz, xsum, 3, K, G, y); return;                                                         \
    default: dot_q4a8_g(codes, sz, xsum, 4, K, G, y); return;                                                        \
    }
    if (a8) switch (g) {
        case 32: A8_M(32)
        case 64: A8_M(64)
        case 128: A8_M(128)
        default: A8_M(256)
        }
#undef A8_M
#else
    (void)a8;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define Q4_M(G, Q5)                                                                                                  \
    switch (M) { /* the token count a constant too: the accumulators stay in registers */                           \
    case 1: dot_q4_g(codes, sz, x, xsum, 1, K, G, Q5, y); return;                                                    \
    case 2: dot_q4_g(codes, sz, x, xsum, 2, K, G, Q5, y); return;                                                    \
    case 3: dot_q4_g(codes, sz, x, xsum, 3, K, G, Q5, y); return;                                                    \
    default: dot_q4_g(codes, sz, x, xsum, 4, K, G, Q5, y); return;                                                   \
    }
    if (q5) Q4_M(32, 1) /* groups of 32 */
    switch (g) { /* the group a constant in each copy */
    case 32: Q4_M(32, 0)
    case 64: Q4_M(64, 0)
    case 128: Q4_M(128, 0)
    default: Q4_M(256, 0)
    }
#undef Q4_M
#else
    dot_rows_scalar(codes, sz, x, xsum, M, K, g, 0, q5, y);
#endif
}

/* INT8 rows in groups of g along K (g = K: one scale a row, the w8a16 scheme; g = 32: GGUF Q8_0 blocks): codes
 * u in [0, 256) ([K] bytes a row; a signed code q is stored as u = q + 128), sz: scales [K / g] then zeros [K / g]
 * (fp32) with w = u * scale + zero. Each code is split into its nibbles, u = 16 hi + lo, each read as the bf16 of
 * 128 + nibble (0x4300 | nibble, exact), so with D_lo = sum_i (128 + lo_i) x_i and D_hi likewise, group j adds
 * scale_j * (D_lo + 16 D_hi) + zero'_j * xsum_j, zero' = zero - 2176 scale (folded in when packing; xsum: the row's
 * group sums, group_sums). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void q8_chunk(const uint8_t *codes, const uint16_t *const *x, int64_t k,
                                                           __mmask32 mask, const int M, __m512 *lo, __m512 *hi) {
    const __m512i lo4 = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, codes + k));
    const __m512i wl = _mm512_ternarylogic_epi32(v, lo4, bias, 0xEA); /* (v & lo4) | bias */
    const __m512i wh = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    for (int m = 0; m < M; m++) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
        lo[m] = _mm512_dpbf16_ps(lo[m], xv, (__m512bh)wl);
        hi[m] = _mm512_dpbf16_ps(hi[m], xv, (__m512bh)wh);
    }
}

static inline __attribute__((always_inline)) void dot_q8_m(const uint8_t *codes, const float *sz,
                                                           const uint16_t *const *x, const float *const *xsum,
                                                           const int M, int64_t K, int64_t g, const int c7,
                                                           float *y) {
    const int64_t nG = K / g;
    const float *scale = sz, *zero = sz + nG;
    const __m512 sixteen = _mm512_set1_ps(16.f);
    __m512 t[MB], lo[MB], hi[MB];
    for (int m = 0; m < M; m++) t[m] = _mm512_setzero_ps();
    int64_t j = 0;
    if (g == 16 && !c7) /* two groups a 32-element chunk: lanes 0-7 sum group j's pairs, lanes 8-15 group j + 1's */
        for (; j + 2 <= nG; j += 2) {
            for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm512_setzero_ps();
            q8_chunk(codes, x, j * 16, (__mmask32)0xffffffffu, M, lo, hi);
            const __m512 sc = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(scale[j]),
                                                   _mm512_set1_ps(scale[j + 1]));
            for (int m = 0; m < M; m++) t[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi[m], sixteen, lo[m]), sc, t[m]);
        }
    if (c7) /* codes below 128 (GGUF Q6_K, groups of 16): each read as the bf16 of 128 + u, one product a weight */
        for (; j + 2 <= nG; j += 2) {
            const __m512i w7 = _mm512_or_si512(
                _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + j * 16))), _mm512_set1_epi16(0x4300));
            const __m512 sc = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(scale[j]),
                                                   _mm512_set1_ps(scale[j + 1]));
            for (int m = 0; m < M; m++)
                t[m] = _mm512_fmadd_ps(dp0(x[m] + j * 16, w7), sc, t[m]);
        }
    if (c7 && j < nG) { /* an odd last group (no GGUF row has one: K is a multiple of 256) */
        const __m512i w7 = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(0xffff, codes + j * 16)),
                                           _mm512_set1_epi16(0x4300));
        for (int m = 0; m < M; m++)
            t[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(),
                                                    (__m512bh)_mm512_maskz_loadu_epi16(0xffff, x[m] + j * 16),
                                                    (__m512bh)w7),
                                   _mm512_set1_ps(scale[j]), t[m]);
        j = nG;
    }
    for (; j < nG; j++) {
        for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm512_setzero_ps();
        const int64_t k1 = (j + 1) * g;
        int64_t k = j * g;
        for (; k + 32 <= k1; k += 32) q8_chunk(codes, x, k, (__mmask32)0xffffffffu, M, lo, hi);
        if (k < k1) q8_chunk(codes, x, k, (__mmask32)((1ull << (k1 - k)) - 1), M, lo, hi); /* the tail: zeros */
        const __m512 sc = _mm512_set1_ps(scale[j]);
        for (int m = 0; m < M; m++) t[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi[m], sixteen, lo[m]), sc, t[m]);
    }
    for (int m = 0; m < M; m++) {
        __m512 z = t[m];
        for (int64_t j = 0; j < nG; j += 16) {
            const __mmask16 k = nG - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nG - j)) - 1);
            z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, zero + j), _mm512_maskz_loadu_ps(k, xsum[m] + j), z);
        }
        y[m] = _mm512_reduce_add_ps(z);
    }
}
#endif

#if HAVE_A8
/* INT8 rows (groups g of 16, 32 or a multiple of 64; K a multiple of 64) against 8-bit activations (act: the rows'
 * act_prep_row data): per span of 64 one vpdpbusd of the u8 codes with the int8 rows, lane l summing elements
 * 4l..4l+3 (lanes 0-7 the span's first block of 32, 8-15 its second, as dxv), scaled by the block's dx and the lane's
 * group scale; the zeros' term zero'_j + bias scale_j (bias 2176, or 128 for the two-level form: c7) against the
 * exact sums. */
static inline __attribute__((always_inline)) void dot_q8a8_g(const uint8_t *codes, const float *sz,
                                                             const float *const *act, const int M, int64_t K,
                                                             const int64_t g, const int c7, float *y) {
    const int64_t nG = K / g;
    const float *scale = sz, *zero = sz + nG;
    const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                  halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 t[MB];
    const float *dxv[MB];
    const int8_t *xq[MB];
    a8_start(act, M, K, nG, t, dxv, xq);
    for (int64_t s = 0; s < K / 64; s++) {
        const __m512i q = _mm512_loadu_si512((const void *)(codes + 64 * s));
        const __m512 sc = g == 16   ? _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(_mm_loadu_ps(scale + 4 * s)))
                          : g == 32 ? _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(
                                                                        _mm_load_sd((const double *)(scale + 2 * s)))))
                                    : _mm512_set1_ps(scale[64 * s / g]);
        for (int m = 0; m < M; m++) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xq[m] + 64 * s));
            t[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(dxv[m] + 16 * s)), sc, t[m]);
        }
    }
    a8_finish(t, act, scale, zero, nG, c7 ? 128.f : 2176.f, M, y);
}
#endif

/* c7: codes below 128 in groups of 16 (the two-level form's INT8 rows, GGUF Q6_K), zero' = zero - 128 scale; a8:
 * against 8-bit activations (dot_q8a8_g; K a multiple of 64, g 16, 32 or a multiple of 64) */
static void dot_rows_q8(const uint8_t *codes, const float *sz, const uint16_t *const *x, const float *const *xsum,
                        int M, int64_t K, int64_t g, int c7, int a8, float *y) {
#if HAVE_A8
#define A8_M(G)                                                                                                      \
    switch (M) {                                                                                                     \
    case 1: dot_q8a8_g(codes, sz, xsum, 1, K, G, c7, y); return;                                                     \
    case 2: dot_q8a8_g(codes, sz, xsum, 2, K, G, c7, y); return;                                                     \
    case 3: dot_q8a8_g(codes, sz, xsum, 3, K, G, c7, y); return;                                                     \
    default: dot_q8a8_g(codes, sz, xsum, 4, K, G, c7, y); return;                                                    \
    }
    if (a8) {
        if (g == 16) A8_M(16)
        if (g == 32) A8_M(32)
        A8_M(g) /* a multiple of 64 */
    }
#undef A8_M
#else
    (void)a8;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define Q8_M(C7)                                                                                                     \
    switch (M) { /* the token count a constant in each copy: the accumulators stay in registers */                  \
    case 1: dot_q8_m(codes, sz, x, xsum, 1, K, g, C7, y); return;                                                    \
    case 2: dot_q8_m(codes, sz, x, xsum, 2, K, g, C7, y); return;                                                    \
    case 3: dot_q8_m(codes, sz, x, xsum, 3, K, g, C7, y); return;                                                    \
    default: dot_q8_m(codes, sz, x, xsum, 4, K, g, C7, y); return;                                                   \
    }
    if (c7) Q8_M(1)
    Q8_M(0)
#undef Q8_M
#else
    dot_rows_scalar(codes, sz, x, xsum, M, K, g, c7 ? 2 : 1, 0, y);
#endif
}

/* A weight of one of three kinds: bf16 rows [.., N, K]; INT4 codes [.., N, K / 2] with sz [.., N, 2, K / g]; or INT8
 * codes [.., N, K] with sz [.., N, 2, K / g] (q8). */
typedef struct {
    const uint16_t *bf16;
    const uint8_t *q4;
    const float *sz;
    int64_t g;
    const uint8_t *q8;
    int q5; /* INT4 codes with a plane of fifth bits after the scales and zeros (q4 set, g = 32) */
    int kf; /* sz in the two-level form of expand_kform (g = 32 INT4, g = 16 INT8) */
    int a8; /* INT4 / INT8 rows against 8-bit activations (dot_q4a8_g, dot_q8a8_g; q5 = 0, INT8: K % 64 = 0) */
} wdesc;

/* sz floats a row of K takes: the plain form's 2 (3 with fifth bits) planes of K / g, or the two-level form's */
static inline int64_t sz_stride(const wdesc *w, int64_t K) {
    return w->kf ? 2 * (K / 256) + K / w->g / 2 : (w->q5 ? 3 : 2) * (K / w->g);
}


/* group sums a token row of K needs for w: K / g (quantized), 0 (bf16) */
static inline int64_t sum_groups(const wdesc *w, int64_t K) { return w->q4 || w->q8 ? act_floats(K, w->g, w->a8) : 0; }

static void row_dot(const wdesc *w, int64_t row, int64_t K, const uint16_t *const *xs, const float *const *ss, int M,
                    float *y) {
    if (w->bf16) {
        dot_rows(w->bf16 + row * K, xs, M, K, y);
        return;
    }
    const float *sz = w->sz + row * sz_stride(w, K);
    float plain[w->kf ? 2 * (K / w->g) : 1];
    if (w->kf) {
        expand_kform(sz, K, w->g, 128.f, plain); /* INT8 rows of this form: codes below 128 (dot_rows_q8's c7) */
        sz = plain;
    }
    if (w->q8)
        dot_rows_q8(w->q8 + row * K, sz, xs, ss, M, K, w->g, w->kf, w->a8, y);
    else
        dot_rows_q4(w->q4 + row * (K / 2), sz, xs, ss, M, K, w->g, w->q5, w->a8, y);
}

/* One unit: rows base + [r0, r1) of w (rows of K) against the n rows of xs (pointers), out rows of stride ldo */
static void unit_gemv(const wdesc *w, int64_t base, int64_t K, int64_t r0, int64_t r1, const uint16_t *const *xs,
                      const float *const *ss, int n, uint16_t *out, int64_t ldo) {
    float y[MB];
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (n == 1 && w->q4) { /* one token: its own copy, accumulators in registers */
        q4_token_rows(w->q4 + base * (K / 2), w->sz + base * sz_stride(w, K), w->g, w->q5, w->kf, w->a8, xs[0], ss[0], K,
                      r0, r1, out);
        return;
    }
#endif
    for (int c = 0; c < n; c += MB) {
        int M = n - c < MB ? n - c : MB;
        for (int64_t r = r0; r < r1; r++) {
            row_dot(w, base + r, K, xs + c, ss + c, M, y);
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
static void moe_experts(const uint16_t *x, int64_t T, int64_t H, int64_t I, const wdesc *gate_up, const wdesc *down,
                        int64_t G, const int64_t *gexp, const int64_t *goff, const int64_t *ptok, const float *pw,
                        uint16_t *h, uint16_t *act, uint16_t *y, float *acc, uint16_t *out, float *sums,
                        int nthreads) {
    const int64_t P = goff[G];
    const int64_t I2 = 2 * I;
    const int64_t nb1 = (I2 + RB - 1) / RB, nb2 = (H + RB - 1) / RB;
    /* sums (quantized weights): [T, H / g] then [P, I / g] group sums (INT4), or [T] then [P] row sums (INT8) */
    const int64_t ngH = sum_groups(gate_up, H), ngI = sum_groups(down, I);
    const int q4 = ngH != 0;
    float *xsum = sums, *asum = q4 ? sums + T * ngH : 0;
#pragma omp parallel num_threads(nthreads)
    {
        const uint16_t *xs[MB];
        const float *ss[MB] = {0, 0, 0, 0};
        if (q4) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) group_sums(x + t * H, H, H / ngH, xsum + t * ngH);
        }
        /* gate_up: units (group, row block) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < G * nb1; u++) {
            int64_t g = u / nb1, b = u % nb1;
            int64_t p0 = goff[g], n = goff[g + 1] - p0;
            for (int64_t c = 0; c < n; c += MB) {
                int M = n - c < MB ? (int)(n - c) : MB;
                for (int m = 0; m < M; m++) {
                    xs[m] = x + ptok[p0 + c + m] * H;
                    if (q4) ss[m] = xsum + ptok[p0 + c + m] * ngH;
                }
                unit_gemv(gate_up, gexp[g] * I2, H, b * RB, (b + 1) * RB < I2 ? (b + 1) * RB : I2, xs, ss, M,
                          h + (p0 + c) * I2, I2);
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
            if (q4) group_sums(ap, I, I / ngI, asum + p * ngI);
        }
        /* down: units (group, row block) */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < G * nb2; u++) {
            int64_t g = u / nb2, b = u % nb2;
            int64_t p0 = goff[g], n = goff[g + 1] - p0;
            for (int64_t c = 0; c < n; c += MB) {
                int M = n - c < MB ? (int)(n - c) : MB;
                for (int m = 0; m < M; m++) {
                    xs[m] = act + (p0 + c + m) * I;
                    if (q4) ss[m] = asum + (p0 + c + m) * ngI;
                }
                unit_gemv(down, gexp[g] * H, I, b * RB, (b + 1) * RB < H ? (b + 1) * RB : H, xs, ss, M,
                          y + (p0 + c) * H, H);
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

void infercore_moe_experts_bf16(const uint16_t *x, int64_t T, int64_t H, int64_t I, const uint16_t *gate_up,
                                const uint16_t *down, int64_t G, const int64_t *gexp, const int64_t *goff,
                                const int64_t *ptok, const float *pw, uint16_t *h, uint16_t *act, uint16_t *y,
                                float *acc, uint16_t *out, int nthreads) {
    wdesc gu = {gate_up, 0, 0, 0, 0, 0, 0, 0}, dn = {down, 0, 0, 0, 0, 0, 0, 0};
    moe_experts(x, T, H, I, &gu, &dn, G, gexp, goff, ptok, pw, h, act, y, acc, out, 0, nthreads);
}

/* The same over INT4 experts: codes gate_up [E, 2I, H / 2], down [E, H, I / 2] (uint8), sz [E, 2I, 2, H / Q4G] and
 * [E, H, 2, I / Q4G] (fp32); H and I multiples of Q4G; sums: workspace of T * H / Q4G + P * I / Q4G floats */
void infercore_moe_experts_q4(const uint16_t *x, int64_t T, int64_t H, int64_t I, const uint8_t *gate_up,
                              const float *gate_up_sz, const uint8_t *down, const float *down_sz, int64_t G,
                              const int64_t *gexp, const int64_t *goff, const int64_t *ptok, const float *pw,
                              uint16_t *h, uint16_t *act, uint16_t *y, float *acc, uint16_t *out, float *sums,
                              int nthreads) {
    wdesc gu = {0, gate_up, gate_up_sz, Q4G, 0, 0, 0, 0}, dn = {0, down, down_sz, Q4G, 0, 0, 0, 0};
    moe_experts(x, T, H, I, &gu, &dn, G, gexp, goff, ptok, pw, h, act, y, acc, out, sums, nthreads);
}

/* Rows [r0, r1) of y [M, N] (row stride ldy) = x [M, K] @ w^T, bf16 x / y, in the token grouping of the GEMVs below
 * (so the same values bit for bit); ss: M rows of group sums for INT4 weights (group_sums), else unused. Opens no
 * OpenMP region. */
static void rows_range(const wdesc *w, const uint16_t *x, int64_t M, int64_t K, const float *ss, int64_t r0, int64_t r1,
                       uint16_t *y, int64_t ldy) {
    const uint16_t *xs[MB];
    const float *sp[MB] = {0, 0, 0, 0};
    for (int64_t c = 0; c < M; c += MB) {
        int m = M - c < MB ? (int)(M - c) : MB;
        for (int j = 0; j < m; j++) {
            xs[j] = x + (c + j) * K;
            if (w->q4 || w->q8) sp[j] = ss + (c + j) * sum_groups(w, K);
        }
        unit_gemv(w, 0, K, r0, r1, xs, sp, m, y + c * ldy, ldy);
    }
}

/* The same over INT8 experts with one scale a row: codes gate_up [E, 2I, H], down [E, H, I] (uint8), sz [E, 2I, 2, 1]
 * and [E, H, 2, 1] (fp32, dot_rows_q8's layout); sums: workspace of T + P floats */
void infercore_moe_experts_q8(const uint16_t *x, int64_t T, int64_t H, int64_t I, const uint8_t *gate_up,
                              const float *gate_up_sz, const uint8_t *down, const float *down_sz, int64_t G,
                              const int64_t *gexp, const int64_t *goff, const int64_t *ptok, const float *pw,
                              uint16_t *h, uint16_t *act, uint16_t *y, float *acc, uint16_t *out, float *sums,
                              int nthreads) {
    wdesc gu = {0, 0, gate_up_sz, H, gate_up, 0, 0, 0}, dn = {0, 0, down_sz, I, down, 0, 0, 0};
    moe_experts(x, T, H, I, &gu, &dn, G, gexp, goff, ptok, pw, h, act, y, acc, out, sums, nthreads);
}

static void linear(const uint16_t *x, int64_t M, int64_t K, const wdesc *w, int64_t N, uint16_t *y, float *sums,
                   int nthreads) {
    const int64_t nb = (N + RB - 1) / RB;
#pragma omp parallel num_threads(nthreads)
    {
        if (w->q4 || w->q8) { /* sums: [M, act_floats(K, g, a8)] */
            const int64_t ng = sum_groups(w, K);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) act_prep_row(x + r * K, K, w->g, w->a8, sums + r * ng);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) rows_range(w, x, M, K, sums, b * RB, (b + 1) * RB < N ? (b + 1) * RB : N, y, N);
    }
}

/* y [M, N] = x [M, K] @ w[N, K]^T, bf16, rows of w in blocks of RB across the threads (a dense decode GEMV) */
void infercore_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, uint16_t *y,
                           int nthreads) {
    wdesc d = {w, 0, 0, 0, 0, 0, 0, 0};
    linear(x, M, K, &d, N, y, 0, nthreads);
}

/* The same over an INT4 weight in groups of g (32, 64, 128, 256): codes [N, K / 2], sz [N, 2, K / g]; K a
 * multiple of g; sums: M * K / g floats */
void infercore_linear_q4(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                         int64_t N, uint16_t *y, float *sums, int nthreads) {
    wdesc d = {0, w, sz, g & ~(KF | A8F), 0, 0, (g & KF) != 0, (g & A8F) != 0 && HAVE_A8};
    linear(x, M, K, &d, N, y, sums, nthreads);
}

/* The same over an INT8 weight in groups of g (dot_rows_q8): codes [N, K], sz [N, 2, K / g]; sums: M * K / g floats */
void infercore_linear_q8(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                         int64_t N, uint16_t *y, float *sums, int nthreads) {
    wdesc d = {0, 0, sz, g & ~(KF | A8F), w, 0, (g & KF) != 0, (g & A8F) != 0 && HAVE_A8 && K % 64 == 0};
    linear(x, M, K, &d, N, y, sums, nthreads);
}

void infercore_q8_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                        const float *sums, int64_t r0, int64_t r1, uint16_t *y, int64_t ldy) {
    wdesc d = {0, 0, sz, g & ~(KF | A8F), w, 0, (g & KF) != 0, (g & A8F) != 0 && HAVE_A8 && K % 64 == 0};
    rows_range(&d, x, M, K, sums, r0, r1, y, ldy);
}

/* For the fused decoder layer (ops/cpu_kernels.c), inside its OpenMP region: rows [r0, r1) of an INT4 linear as
 * infercore_linear_q4 computes them (infercore_q8_range above: INT8), the rows' data from infercore_act_prep */

void infercore_q4_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                        const float *sums, int64_t r0, int64_t r1, uint16_t *y, int64_t ldy) {
    wdesc d = {0, w, sz, g & ~(KF | A8F), 0, 0, (g & KF) != 0, (g & A8F) != 0 && HAVE_A8};
    rows_range(&d, x, M, K, sums, r0, r1, y, ldy);
}

/* The same over 5-bit codes in groups of 32 (GGUF Q5_0 / Q5_1 / Q5_K): the INT4 layout for the low four bits, and sz
 * [N, 3, K / 32], its third plane each group's fifth bits as a 32-bit word (dot_q4_g) */
void infercore_linear_q5(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                         int64_t N, uint16_t *y, float *sums, int nthreads) {
    (void)g; /* 32: the argument list of infercore_linear_q4 */
    wdesc d = {0, w, sz, 32, 0, 1, 0, 0};
    linear(x, M, K, &d, N, y, sums, nthreads);
}

void infercore_q5_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, const float *sums,
                        int64_t r0, int64_t r1, uint16_t *y, int64_t ldy) {
    wdesc d = {0, w, sz, 32, 0, 1, 0, 0};
    rows_range(&d, x, M, K, sums, r0, r1, y, ldy);
}

/* Rows [r0, r1) of an INT4 weight (kind 0: codes [N, Kp / 2] in the kernels' layout), an INT8 one (kind 1: codes
 * [N, Kp]) or a 5-bit one (kind 2: the INT4 codes, sz's third plane the fifth bits, g = 32) in groups of g (g | KF:
 * sz in the two-level form, expand_kform), sz
 * [N, 2 (3), Kp / g], decoded to bf16 rows out [r1 - r0, Kp] (round to nearest even): w = (128 + q) scale + zero'
 * (INT4, 5-bit) or u scale + zero' + 2176 scale (INT8), the values the GEMVs multiply by. For prefill-sized row
 * counts: a slice decoded here, then a dense GEMM (quant/cpu.py). */
void infercore_dequant_rows(const uint8_t *codes, const float *sz, int64_t Kp, int64_t g, int kind, int64_t r0,
                            int64_t r1, uint16_t *out, int nthreads) {
    const int kf = (g & KF) != 0;
    g &= ~KF;
    const int64_t nG = Kp / g, k64 = Kp / 64 * 64;
    const int q8 = kind == 1, q5 = kind == 2;
    const int64_t stride = kf ? 2 * (Kp / 256) + nG / 2 : (q5 ? 3 : 2) * nG;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        float plain[kf ? 2 * nG : 1];
        const float *sc = sz + r * stride;
        if (kf) {
            expand_kform(sc, Kp, g, 128.f, plain);
            sc = plain;
        }
        const float *ze = sc + nG;
        const uint32_t *hb = (const uint32_t *)(ze + nG);
        uint16_t *o = out + (r - r0) * Kp;
        if (q8) {
            const uint8_t *c = codes + r * Kp;
            for (int64_t j = 0; j < nG; j++) {
                const float s = sc[j], z = ze[j] + (kf ? 128.f : 2176.f) * s;
                for (int64_t i = j * g; i < (j + 1) * g; i++) o[i] = f32_to_bf16((float)c[i] * s + z);
            }
            continue;
        }
        const uint8_t *c = codes + r * (Kp / 2);
        for (int64_t sp = 0; sp < k64 / 64; sp++) { /* a span of 64 in 32 bytes: byte b holds b and 32 + b */
            const int64_t e0 = 64 * sp;
            const float s0 = sc[e0 / g], z0 = ze[e0 / g], s1 = sc[(e0 + 32) / g], z1 = ze[(e0 + 32) / g];
            const uint8_t *v = c + 32 * sp;
            const uint32_t h0 = q5 ? hb[e0 / 32] : 0, h1 = q5 ? hb[e0 / 32 + 1] : 0;
            for (int b = 0; b < 32; b++)
                o[e0 + b] = f32_to_bf16((float)(128 + (v[b] & 15) + 16 * (int)((h0 >> b) & 1)) * s0 + z0);
            for (int b = 0; b < 32; b++)
                o[e0 + 32 + b] = f32_to_bf16((float)(128 + (v[b] >> 4) + 16 * (int)((h1 >> b) & 1)) * s1 + z1);
        }
        if (k64 < Kp) { /* g = 32: the last group in 16 bytes, byte b holding b and 16 + b */
            const float s = sc[nG - 1], z = ze[nG - 1];
            const uint8_t *v = c + k64 / 2;
            const uint32_t h = q5 ? hb[nG - 1] : 0;
            for (int b = 0; b < 16; b++)
                o[k64 + b] = f32_to_bf16((float)(128 + (v[b] & 15) + 16 * (int)((h >> b) & 1)) * s + z);
            for (int b = 0; b < 16; b++)
                o[k64 + 16 + b] = f32_to_bf16((float)(128 + (v[b] >> 4) + 16 * (int)((h >> (16 + b)) & 1)) * s + z);
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

/* ---- fp32 GEMV ------------------------------------------------------------------------------------------------ */

/* y[m] = sum_k x[m][k] * w[k] for m < M (<= MB), fp32; one row: four accumulator chains */
static void dot_rows_f32(const float *w, const float *const *x, int M, int64_t K, float *y) {
#if defined(__AVX512F__)
    if (M == 1) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *x0 = x[0];
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), _mm512_loadu_ps(w + k), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k + 16), _mm512_loadu_ps(w + k + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k + 32), _mm512_loadu_ps(w + k + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k + 48), _mm512_loadu_ps(w + k + 48), a3);
        }
        for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x0 + k), _mm512_loadu_ps(w + k), a0);
        if (k < K) {
            const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x0 + k), _mm512_maskz_loadu_ps(mask, w + k), a1);
        }
        y[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    __m512 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(w + k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x[m] + k), wv, acc[m]);
    }
    if (k < K) {
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        const __m512 wv = _mm512_maskz_loadu_ps(mask, w + k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x[m] + k), wv, acc[m]);
    }
    for (int m = 0; m < M; m++) y[m] = _mm512_reduce_add_ps(acc[m]);
#else
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        for (int64_t j = 0; j < K; j++) s += x[m][j] * w[j];
        y[m] = s;
    }
#endif
}

/* y [M, N] = x [M, K] @ w [N, K]^T, fp32, rows of w in blocks of RB across the threads */
void infercore_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int nthreads) {
    const int64_t nb = (N + RB - 1) / RB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const float *xs[MB];
        float yt[MB];
        const int64_t r1 = (b + 1) * RB < N ? (b + 1) * RB : N;
        for (int64_t c = 0; c < M; c += MB) {
            const int m = M - c < MB ? (int)(M - c) : MB;
            for (int j = 0; j < m; j++) xs[j] = x + (c + j) * K;
            for (int64_t r = b * RB; r < r1; r++) {
                dot_rows_f32(w + r * K, xs, m, K, yt);
                for (int j = 0; j < m; j++) y[(c + j) * N + r] = yt[j];
            }
        }
    }
}

/* Rows [r0, r1) of y [M, N] (row stride ldy) = x [M, K] @ w [N, K]^T, bf16 (dt 1) or fp32 (dt 0), with the token
 * grouping and sums of infercore_linear_bf16 / _f32 (the same values bit for bit). Opens no OpenMP region: for
 * callers splitting rows inside their own (ops/cpu_kernels.c's fused decoder layer). */
void infercore_gemv_range(const void *x, int64_t M, int64_t K, const void *w, int64_t r0, int64_t r1, void *y,
                          int64_t ldy, int dt) {
    float yt[MB];
    for (int64_t c = 0; c < M; c += MB) {
        const int m = M - c < MB ? (int)(M - c) : MB;
        if (dt) {
            const uint16_t *xs[MB];
            for (int j = 0; j < m; j++) xs[j] = (const uint16_t *)x + (c + j) * K;
            for (int64_t r = r0; r < r1; r++) {
                dot_rows((const uint16_t *)w + r * K, xs, m, K, yt);
                for (int j = 0; j < m; j++) ((uint16_t *)y)[(c + j) * ldy + r] = f32_to_bf16(yt[j]);
            }
        } else {
            const float *xs[MB];
            for (int j = 0; j < m; j++) xs[j] = (const float *)x + (c + j) * K;
            for (int64_t r = r0; r < r1; r++) {
                dot_rows_f32((const float *)w + r * K, xs, m, K, yt);
                for (int j = 0; j < m; j++) ((float *)y)[(c + j) * ldy + r] = yt[j];
            }
        }
    }
}

/* ---- FP8 e4m3 weights ----------------------------------------------------------------------------------------- */

/* The bf16 bits of an e4m3 byte, exact (3 mantissa bits, exponents -9..8): sign | ((mag << 4) + (120 << 7)) for a
 * normal byte (exponent field E >= 1: bf16 exponent E + 120); m * 2^-9 for the subnormals (E = 0); NaN (0x7F /
 * 0xFF) -> a bf16 NaN. */
static inline uint16_t e4m3_bf16(uint8_t b) {
    const int mag = b & 0x7F, sign = (b & 0x80) << 8;
    if (mag == 0x7F) return (uint16_t)(sign | 0x7FC0);
    if (mag >= 8) return (uint16_t)(sign | ((mag << 4) + 0x3C00));
    const float f = (float)mag * (1.0f / 512.0f);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(sign | (u >> 16));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 32 e4m3 bytes -> 32 bf16 (e4m3_bf16 in vector form; sub: its first 8 entries, the subnormals' bits) */
static inline __attribute__((always_inline)) __m512i e4m3x32_bf16(__m256i bytes, __m512i sub) {
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, sub);
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7FC0));
    return _mm512_ternarylogic_epi32(r, _mm512_slli_epi16(v, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* r|(b&c) */
}
#endif

/* y[m] = sum over K-blocks j of s[j] * sum_{k in block j} x[m][k] * e4m3(w[k]), blocks of bk along K (bk = K: one
 * scale a row), the inner sums in fp32 (vdpbf16ps over the exact bf16 of each code), m < M <= MB */
static void dot_rows_fp8(const uint8_t *w, const float *s, int64_t bk, const uint16_t *const *x, int M, int64_t K,
                         float *y) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    static const uint16_t lut[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60}; /* m * 2^-9 */
    const __m512i sub = _mm512_loadu_si512((const void *)lut);
    __m512 t[MB], a[MB];
    for (int m = 0; m < M; m++) t[m] = _mm512_setzero_ps();
    for (int64_t k0 = 0, j = 0; k0 < K; k0 += bk, j++) {
        const int64_t k1 = k0 + bk < K ? k0 + bk : K;
        for (int m = 0; m < M; m++) a[m] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 32 <= k1; k += 32) {
            const __m512bh wv = (__m512bh)e4m3x32_bf16(_mm256_loadu_si256((const __m256i *)(w + k)), sub);
            for (int m = 0; m < M; m++)
                a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512((const void *)(x[m] + k)), wv);
        }
        if (k < k1) {
            const __mmask32 mask = (__mmask32)((1ull << (k1 - k)) - 1);
            const __m512bh wv = (__m512bh)e4m3x32_bf16(_mm256_maskz_loadu_epi8(mask, w + k), sub);
            for (int m = 0; m < M; m++)
                a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k), wv);
        }
        const __m512 sv = _mm512_set1_ps(s[j]);
        for (int m = 0; m < M; m++) t[m] = _mm512_fmadd_ps(a[m], sv, t[m]);
    }
    for (int m = 0; m < M; m++) y[m] = _mm512_reduce_add_ps(t[m]);
#else
    for (int m = 0; m < M; m++) {
        float tot = 0.f;
        for (int64_t k0 = 0, j = 0; k0 < K; k0 += bk, j++) {
            const int64_t k1 = k0 + bk < K ? k0 + bk : K;
            float acc = 0.f;
            for (int64_t k = k0; k < k1; k++) acc += bf16_to_f32(x[m][k]) * bf16_to_f32(e4m3_bf16(w[k]));
            tot += acc * s[j];
        }
        y[m] = tot;
    }
#endif
}

/* Rows [r0, r1) of y [M, N] (row stride ldy) bf16 = x [M, K] bf16 @ dequant(w)^T for e4m3 codes w [N, K] with fp32
 * scales: blk = 0, one a row (scales [N]); blk = 128, 128 x 128 blocks (scales [ceil(N / 128), ceil(K / 128)]).
 * Opens no OpenMP region (the fused decoder layer calls it inside its own). */
void infercore_fp8_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *scales, int64_t blk,
                         int64_t r0, int64_t r1, uint16_t *y, int64_t ldy) {
    const int64_t kb = blk ? (K + blk - 1) / blk : 1, bk = blk ? blk : K;
    const uint16_t *xs[MB];
    float yt[MB];
    for (int64_t c = 0; c < M; c += MB) {
        const int m = M - c < MB ? (int)(M - c) : MB;
        for (int j = 0; j < m; j++) xs[j] = x + (c + j) * K;
        for (int64_t r = r0; r < r1; r++) {
            dot_rows_fp8(w + r * K, blk ? scales + (r / blk) * kb : scales + r, bk, xs, m, K, yt);
            for (int j = 0; j < m; j++) y[(c + j) * ldy + r] = f32_to_bf16(yt[j]);
        }
    }
}

/* Rows [r0, r1) of the weight behind e4m3 codes w [N, K] with fp32 scales (blk as infercore_fp8_range) decoded to
 * bf16 rows out [r1 - r0, K]: e4m3(w) * scale rounded to nearest even, the reference's weight rounded to bf16. For
 * prefill-sized row counts: a slice decoded here, then a dense GEMM (quant/cpu.py). */
void infercore_dequant_fp8_rows(const uint8_t *w, const float *scales, int64_t K, int64_t blk, int64_t r0, int64_t r1,
                                uint16_t *out, int nthreads) {
    const int64_t kb = blk ? (K + blk - 1) / blk : 1, bk = blk ? blk : K;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = w + r * K;
        const float *s = blk ? scales + (r / blk) * kb : scales + r;
        uint16_t *o = out + (r - r0) * K;
        for (int64_t k0 = 0, j = 0; k0 < K; k0 += bk, j++) {
            const int64_t k1 = k0 + bk < K ? k0 + bk : K;
            int64_t k = k0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            static const uint16_t lut[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
            const __m512i sub = _mm512_loadu_si512((const void *)lut);
            const __m512 sv = _mm512_set1_ps(s[j]);
            for (; k + 32 <= k1; k += 32) {
                const __m512i b = e4m3x32_bf16(_mm256_loadu_si256((const __m256i *)(c + k)), sub);
                const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm512_castsi512_si256(b)), 16));
                const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm512_extracti64x4_epi64(b, 1)), 16));
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sv), _mm512_mul_ps(lo, sv));
                _mm512_storeu_si512((void *)(o + k), (__m512i)v);
            }
#endif
            for (; k < k1; k++) o[k] = f32_to_bf16(bf16_to_f32(e4m3_bf16(c[k])) * s[j]);
        }
    }
}

/* ---- 4-bit codebook weights (bitsandbytes NF4 / FP4) ---------------------------------------------------------- */

/* Rows [r0, r1) of the weight behind 4-bit codes w [N, K / 2] (element 2j in the low nibble of byte j) into a 16-entry
 * fp32 codebook lut, one fp32 absmax a block of bs along K (absmax [N, K / bs]), decoded to bf16 rows out
 * [r1 - r0, K]: lut[code] * absmax rounded to nearest even. For prefill-sized row counts (and the decode rows
 * too): a slice decoded here, then a dense GEMM (quant/cpu.py). */
void infercore_dequant_lut4_rows(const uint8_t *w, const float *absmax, const float *lut, int64_t K, int64_t bs,
                                 int64_t r0, int64_t r1, uint16_t *out, int nthreads) {
    const int64_t nb = K / bs;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = w + r * (K / 2);
        const float *am = absmax + r * nb;
        uint16_t *o = out + (r - r0) * K;
        int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        const __m512 table = _mm512_loadu_ps(lut);
        const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        if (bs % 32 == 0)
            for (; k < K; k += 32) { /* 16 bytes: 32 weights of one block */
                const __m512 sv = _mm512_set1_ps(am[k / bs]);
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + k / 2)));
                const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table),
                                                sv);
                const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sv);
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(lo, i1, hi),
                                                       _mm512_permutex2var_ps(lo, i0, hi));
                _mm512_storeu_si512((void *)(o + k), (__m512i)v);
            }
#endif
        for (; k < K; k += 2) {
            const float s = am[k / bs];
            o[k] = f32_to_bf16(lut[c[k / 2] & 15] * s);
            o[k + 1] = f32_to_bf16(lut[c[k / 2] >> 4] * s);
        }
    }
}

/* y[m] = sum_k x[m][k] * (lut[code k] * absmax[k / bs]) in fp32 (each weight scaled first, as the reference); the
 * activations come split into even (xe) and odd (xo) elements, fp32, so that a byte's two codes (low nibble: the
 * even element) multiply aligned vectors; m < M <= MB. Several independent accumulators a row: one chain of
 * dependent FMAs would bound the loop by FMA latency. */
static void dot_rows_lut4(const uint8_t *w, const float *am, int64_t bs, const float *const *xe,
                          const float *const *xo, int M, int64_t K, const float *lut, float *y) {
    int64_t k = 0;
    float t[MB] = {0};
#if defined(__AVX512F__)
    if (bs % 32 == 0) {
        const __m512 table = _mm512_loadu_ps(lut);
        const __m512i low = _mm512_set1_epi32(15);
        if (M == 1) {
            const float *e = xe[0], *o = xo[0];
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
            for (; k + 64 <= K; k += 64) { /* 64 weights: one block of 32 or more, or two of 32 */
                const __m512 s0 = _mm512_set1_ps(am[k / bs]), s1 = _mm512_set1_ps(am[(k + 32) / bs]);
                const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2)));
                const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2 + 16)));
                a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(c0, low), table), s0),
                                     _mm512_loadu_ps(e + k / 2), a0);
                b0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table), s0),
                                     _mm512_loadu_ps(o + k / 2), b0);
                a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(c1, low), table), s1),
                                     _mm512_loadu_ps(e + k / 2 + 16), a1);
                b1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), table), s1),
                                     _mm512_loadu_ps(o + k / 2 + 16), b1);
            }
            for (; k < K; k += 32) {
                const __m512 s0 = _mm512_set1_ps(am[k / bs]);
                const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2)));
                a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(c0, low), table), s0),
                                     _mm512_loadu_ps(e + k / 2), a0);
                b0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), table), s0),
                                     _mm512_loadu_ps(o + k / 2), b0);
            }
            y[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(b0, b1)));
            return;
        }
        __m512 a[MB], b[MB];
        for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();
        for (; k < K; k += 32) {
            const __m512 sv = _mm512_set1_ps(am[k / bs]);
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2)));
            const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(c, low), table), sv);
            const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table), sv);
            for (int m = 0; m < M; m++) {
                a[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe[m] + k / 2), a[m]);
                b[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo[m] + k / 2), b[m]);
            }
        }
        for (int m = 0; m < M; m++) t[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
    }
#endif
    for (; k < K; k += 2) {
        const float s = am[k / bs], lo = lut[w[k / 2] & 15] * s, hi = lut[w[k / 2] >> 4] * s;
        for (int m = 0; m < M; m++) t[m] += xe[m][k / 2] * lo + xo[m][k / 2] * hi;
    }
    for (int m = 0; m < M; m++) y[m] = t[m];
}

/* The activations of the codebook GEMV: each row of x [M, K] bf16 split into its even and odd elements, fp32, into
 * xs [M, K] (row m: K / 2 even, then K / 2 odd) */
void infercore_lut4_prep(const uint16_t *x, int64_t M, int64_t K, float *xs) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 2) {
            xs[m * K + k / 2] = bf16_to_f32(x[m * K + k]);
            xs[m * K + K / 2 + k / 2] = bf16_to_f32(x[m * K + k + 1]);
        }
}

/* Rows [r0, r1) of y [M, N] (row stride ldy) bf16 = x @ (lut[code] * absmax)^T for 4-bit codes w [N, K / 2] (element
 * 2j in the low nibble of byte j), lutabs = the codebook (16 fp32) followed by absmax [N, K / bs], the activations
 * as infercore_lut4_prep leaves them in xs. Opens no OpenMP region (the fused decoder layer calls it in its own). */
void infercore_lut4_range(const float *xs, int64_t M, int64_t K, const uint8_t *w, const float *lutabs, int64_t bs,
                          int64_t r0, int64_t r1, uint16_t *y, int64_t ldy) {
    const float *xe[MB], *xo[MB];
    float yt[MB];
    for (int64_t c = 0; c < M; c += MB) {
        const int m = M - c < MB ? (int)(M - c) : MB;
        for (int j = 0; j < m; j++) {
            xe[j] = xs + (c + j) * K;
            xo[j] = xs + (c + j) * K + K / 2;
        }
        for (int64_t r = r0; r < r1; r++) {
            dot_rows_lut4(w + r * (K / 2), lutabs + 16 + r * (K / bs), bs, xe, xo, m, K, lutabs, yt);
            for (int j = 0; j < m; j++) y[(c + j) * ldy + r] = f32_to_bf16(yt[j]);
        }
    }
}

/* y [M, N] bf16 = x [M, K] bf16 @ (lut[code] * absmax)^T (infercore_lut4_range; lutabs: the codebook then absmax
 * [N, K / bs]), rows of w in blocks of RB across the threads. Returns 0, or -1 when the activation buffer cannot be
 * allocated. */
int infercore_linear_lut4(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *lutabs, int64_t bs,
                          int64_t N, uint16_t *y, int nthreads) {
    float *xs = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xs) return -1;
    infercore_lut4_prep(x, M, K, xs);
    const int64_t nb = (N + RB - 1) / RB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nb; b++)
        infercore_lut4_range(xs, M, K, w, lutabs, bs, b * RB, (b + 1) * RB < N ? (b + 1) * RB : N, y, N);
    free(xs);
    return 0;
}

/* All of y [M, N] (infercore_fp8_range), rows of w in blocks of RB across the threads */
void infercore_linear_fp8(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *scales, int64_t blk,
                          int64_t N, uint16_t *y, int nthreads) {
    const int64_t nb = (N + RB - 1) / RB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nb; b++)
        infercore_fp8_range(x, M, K, w, scales, blk, b * RB, (b + 1) * RB < N ? (b + 1) * RB : N, y, N);
}
