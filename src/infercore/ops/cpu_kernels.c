/* Host CPU kernels of the per-token ops of a decoder layer: RMSNorm (with the residual add), RoPE fused with the
 * KV-cache write, SiLU-and-mul, and paged decode attention. fp32 or bf16 tensors (dt: 0 fp32, 1 bf16).
 *
 * Built with ops/moe/cpu_experts.c into one library by infercore/ops/moe/cpu_native.py and called through ctypes.
 * At decode sizes these ops are a few microseconds of arithmetic; through ATen each costs tens of microseconds of
 * dispatch, dtype conversions and temporaries. Each kernel computes what its reference (ops/<op>/naive.py)
 * computes, in fp32, and rounds where the reference rounds; sums accumulate in another order (per lane, then
 * across lanes). Built in ISO C mode, so no multiply-add is contracted into an FMA the reference does not do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_bf16.h"

#define LANES 16 /* independent partial sums, in lanes the compiler vectorizes */


static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* the value rounded to the tensor's dtype and read back (what torch's .to(dtype) keeps) */
static inline __attribute__((always_inline)) float rnd(float v, const int bf) {
    return bf ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float v, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* rows of n values into f (fp32) */
static inline __attribute__((always_inline)) void ld_row(const void *p, int64_t off, int64_t n, float *f,
                                                         const int bf) {
    for (int64_t i = 0; i < n; i++) f[i] = ld(p, off + i, bf);
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void rms_rows(const void *x, const void *res, void *res_out,
                                                           const void *w, void *out, int64_t r0, int64_t r1,
                                                           int64_t D, float eps, float offset, const int bf,
                                                           const int wbf, float *buf) {
    for (int64_t r = r0; r < r1; r++) {
        const int64_t o = r * D;
        float acc[LANES] = {0};
        for (int64_t i = 0; i < D; i++) { /* the residual sum rounded to the dtype first, as the reference */
            float v = ld(x, o + i, bf);
            if (res) {
                v = rnd(v + ld(res, o + i, bf), bf);
                st(res_out, o + i, v, bf);
            }
            buf[i] = v;
        }
        int64_t i = 0;
        for (; i + LANES <= D; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += buf[i + l] * buf[i + l];
        float ss = 0.f;
        for (int l = 0; l < LANES; l++) ss += acc[l];
        for (; i < D; i++) ss += buf[i] * buf[i];
        const float rstd = 1.f / sqrtf(ss / (float)D + eps);
        for (i = 0; i < D; i++) st(out, o + i, (buf[i] * rstd) * (ld(w, i, wbf) + offset), bf);
    }
}

/* rms_rows with its dtypes as run-time flags: one specialized copy per combination */
static void rms_any(const void *x, const void *res, void *res_out, const void *w, void *out, int64_t r0, int64_t r1,
                    int64_t D, float eps, float offset, int bf, int wbf, float *buf) {
    if (bf && wbf)
        rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 1, 1, buf);
    else if (bf)
        rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 1, 0, buf);
    else if (wbf)
        rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 0, 1, buf);
    else
        rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 0, 0, buf);
}

/* out [T, D] = rmsnorm(x (+ res)) * (w + offset); with res, res_out [T, D] = x + res rounded (may alias x / res).
 * dt / wdt: dtypes of x (res, out) and of w. */
void infercore_rms_norm(const void *x, const void *res, void *res_out, const void *w, void *out, int64_t T,
                        int64_t D, float eps, float offset, int dt, int wdt, int nthreads) {
    const int par = T >= 16 && nthreads > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        float *buf = (float *)malloc((size_t)D * sizeof(float));
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t r0 = T * id / nt, r1 = T * (id + 1) / nt;
        rms_any(x, res, res_out, w, out, r0, r1, D, eps, offset, dt, wdt, buf);
        free(buf);
    }
}

/* ---- SiLU-and-mul ----------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void silu_rows(const void *x, void *out, int64_t r0, int64_t r1,
                                                            int64_t d, const int bf) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < d; i++) {
            const float g = ld(x, r * 2 * d + i, bf), u = ld(x, r * 2 * d + d + i, bf);
            st(out, r * d + i, g / (1.f + expf(-g)) * u, bf);
        }
}

#if defined(__AVX512F__)
static void silu_rows_simd(const void *x, void *out, int64_t r0, int64_t r1, int64_t d, const int bf);
#endif

static void silu_any(const void *x, void *out, int64_t r0, int64_t r1, int64_t d, int bf) {
#if defined(__AVX512F__)
    silu_rows_simd(x, out, r0, r1, d, bf);
#else
    if (bf)
        silu_rows(x, out, r0, r1, d, 1);
    else
        silu_rows(x, out, r0, r1, d, 0);
#endif
}

/* out [T, d] = silu(x[:, :d]) * x[:, d:] in fp32, rounded once */
void infercore_silu_and_mul(const void *x, void *out, int64_t T, int64_t d, int dt, int nthreads) {
    const int par = T * d >= 65536 && nthreads > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t r0 = T * id / nt, r1 = T * (id + 1) / nt;
        silu_any(x, out, r0, r1, d, dt);
    }
}

/* ---- multi-LoRA: one adapter per token (lora.LoRALinear's CPU decode path) --------------------------------- */

/* y [T, N] (dt) += the LoRA of each token t whose slot s = idx[t] is >= 0: lo = A[s] . x[t] (A fp32 [S, R, K]),
 * then y[t, n] += lo[j * r : (j + 1) * r] . B[s][n] (B fp32 [S, N, r]) for column n of slice j = the number of
 * bounds b0 <= b1 <= b2 at or below n (unused bounds = N), summed in fp32 and rounded to y's dtype once. */
void infercore_lora_apply(const void *x, void *y, const float *a, const float *b, const int64_t *idx, int64_t T,
                          int64_t K, int64_t N, int64_t R, int64_t r, int64_t b0, int64_t b1, int64_t b2, int dt,
                          int nthreads) {
    const int bf = dt == 1;
    const int par = T * (R * K + N * r) >= 262144 && nthreads > 1;
    float *xf = malloc(sizeof(float) * (size_t)K * (size_t)(par ? nthreads : 1));
    float *lo = malloc(sizeof(float) * (size_t)R * (size_t)T);
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        float *xt = xf + (size_t)K * (size_t)omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const int64_t s = idx[t];
            if (s < 0) continue;
            ld_row(x, t * K, K, xt, bf);
            const float *as = a + s * R * K;
            for (int64_t i = 0; i < R; i++) lo[t * R + i] = dot_f32(as + i * K, xt, K);
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < 8; c++) { /* eighths of the columns: work for every thread at one token */
                const int64_t s = idx[t];
                if (s < 0) continue;
                const float *bs = b + s * N * r;
                for (int64_t n = N * c / 8; n < N * (c + 1) / 8; n++) {
                    const int64_t j = (n >= b0) + (n >= b1) + (n >= b2);
                    const float *l = lo + t * R + j * r, *bn = bs + n * r;
                    float acc = 0.f;
                    for (int64_t k = 0; k < r; k++) acc += l[k] * bn[k];
                    st(y, t * N + n, ld(y, t * N + n, bf) + acc, bf);
                }
            }
    }
    free(xf);
    free(lo);
}

/* ---- RoPE (neox, full rotary) with the KV-cache write ----------------------------------------------------- */

/* float8_e4m3fn code of v (|v| <= 448, as the quantizer clamps), rounded to nearest even like torch's conversion:
 * below 2^-6 a multiple of 2^-9 (subnormals, codes 0-8), else 3 mantissa bits */
static inline uint8_t e4m3_code(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
    const float a = fabsf(v);
    if (!(a == a)) return (uint8_t)(sign | 0x7f); /* NaN */
    if (a < 0.015625f) return (uint8_t)(sign | (uint8_t)nearbyintf(a * 512.f));
    memcpy(&b, &a, 4);
    const uint32_t e = (b >> 23) - 127 + 7, m = b & 0x7fffff;
    const uint32_t r = m + 0x7ffff + ((m >> 20) & 1); /* to 3 bits, ties to even; a carry bumps the exponent */
    const uint32_t code = (e << 3) + (r >> 20);
    return (uint8_t)(sign | (code > 0x7e ? 0x7e : code));
}

/* One cache row of D values (f, already rounded to the layer dtype) as 1-byte codes (kv 1 int8, 2 float8_e4m3fn)
 * and its fp32 scale, as ops.kv_cache.quant.quantize_kv_ref computes them: scale = max(amax, 1e-8) / qmax, code =
 * x / scale rounded half away from zero (int8, clamped to +-127) or to nearest even (e4m3, clamped to +-448) */
static void quant_row(const float *f, int64_t D, int kv, uint8_t *codes, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(f[i]));
    const float s = fmaxf(amax, 1e-8f) / (kv == 1 ? 127.f : 448.f);
    *scale = s;
    for (int64_t i = 0; i < D; i++) {
        const float x = f[i] / s;
        if (kv == 1) {
            float r = x >= 0.f ? floorf(x + 0.5f) : ceilf(x - 0.5f);
            r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
            codes[i] = (uint8_t)(int8_t)r;
        } else {
            codes[i] = e4m3_code(x > 448.f ? 448.f : x < -448.f ? -448.f : x);
        }
    }
}

/* kv 0: caches of the rows' dtype; kv 1 / 2: 1-byte codes with fp32 scales ksc / vsc [num_slots, Hk] (f: D floats
 * of scratch) */
static inline __attribute__((always_inline)) void rope_rows(const void *q, const void *k, const void *v,
                                                            const int64_t *pos, const float *cs,
                                                            void *kc, void *vc, const int32_t *slots,
                                                            void *q_out, int64_t t0, int64_t t1, int64_t Hq,
                                                            int64_t Hk, int64_t D, int64_t sq, int64_t sk,
                                                            int64_t sv, const int bf, int kv, float *ksc, float *vsc,
                                                            float *f) {
    const int64_t half = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *cos = cs + pos[t] * D, *sin = cos + half;
        const int store = slots[t] >= 0; /* slot -1: the row's K/V are not stored */
        for (int64_t h = 0; h < (store ? Hq + Hk : Hq); h++) {
            const void *src = h < Hq ? q : k;
            const int64_t si = h < Hq ? t * sq + h * D : t * sk + (h - Hq) * D;
            const int64_t di = h < Hq ? (t * Hq + h) * D : ((int64_t)slots[t] * Hk + h - Hq) * D;
            if (h >= Hq && kv) { /* the rotated key rounded to the rows' dtype, then its codes and scale */
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = ld(src, si + i, bf), x2 = ld(src, si + half + i, bf);
                    f[i] = rnd(x1 * cos[i] - x2 * sin[i], bf);
                    f[half + i] = rnd(x2 * cos[i] + x1 * sin[i], bf);
                }
                quant_row(f, D, kv, (uint8_t *)kc + di, ksc + (int64_t)slots[t] * Hk + h - Hq);
                continue;
            }
            void *dst = h < Hq ? q_out : kc;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = ld(src, si + i, bf), x2 = ld(src, si + half + i, bf);
                st(dst, di + i, x1 * cos[i] - x2 * sin[i], bf);
                st(dst, di + half + i, x2 * cos[i] + x1 * sin[i], bf);
            }
        }
        if (!store) continue;
        if (kv) {
            for (int64_t h = 0; h < Hk; h++) {
                ld_row(v, t * sv + h * D, D, f, bf);
                quant_row(f, D, kv, (uint8_t *)vc + ((int64_t)slots[t] * Hk + h) * D, vsc + (int64_t)slots[t] * Hk + h);
            }
        } else {
            const size_t vb = (size_t)(Hk * D) * (bf ? 2 : 4);
            memcpy((char *)vc + (size_t)slots[t] * vb, (const char *)v + (size_t)(t * sv) * (bf ? 2 : 4), vb);
        }
    }
}

/* q / k / v rows of strides sq / sk / sv elements (their heads contiguous); q_out contiguous [T, Hq, D] */
static void rope_any(const void *q, const void *k, const void *v, const int64_t *pos, const float *cs, void *kc,
                     void *vc, const int32_t *slots, void *q_out, int64_t t0, int64_t t1, int64_t Hq, int64_t Hk,
                     int64_t D, int64_t sq, int64_t sk, int64_t sv, int bf, int kv, float *ksc, float *vsc) {
    float f[kv ? D : 1];
    if (bf)
        rope_rows(q, k, v, pos, cs, kc, vc, slots, q_out, t0, t1, Hq, Hk, D, sq, sk, sv, 1, kv, ksc, vsc, f);
    else
        rope_rows(q, k, v, pos, cs, kc, vc, slots, q_out, t0, t1, Hq, Hk, D, sq, sk, sv, 0, kv, ksc, vsc, f);
}

/* The rows' slots (-1: not stored) and positions checked before anything is written: 0, -1 - t for a slot out of
 * range at row t, -1 - T - t for a position out of range. */
static int check_rows(const int32_t *slots, const int64_t *pos, int64_t T, int64_t num_slots, int64_t max_pos) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < -1 || slots[t] >= num_slots) return (int)(-1 - t);
        if (pos[t] < 0 || pos[t] >= max_pos) return (int)(-1 - T - t);
    }
    return 0;
}

/* q [T, Hq, D], k / v [T, Hk, D] (contiguous); pos int64 [T] in [0, max_pos); cs fp32 [max_pos, D] = [cos | sin];
 * caches [num_slots = pages * page_size, Hk, D] of the same dtype (kv 0), or of 1-byte codes (kv 1 int8, 2
 * float8_e4m3fn) with fp32 scales ksc / vsc [num_slots, Hk] (quant_row); slots int32 [T] in [-1, num_slots) (-1: the
 * row's K/V are not stored). q_out [T, Hq, D] gets rotated q. Returns check_rows' code (nothing written if < 0). */
int infercore_rope_write_kv(const void *q, const void *k, const void *v, const int64_t *pos, const float *cs,
                            void *kc, void *vc, const int32_t *slots, void *q_out, int64_t T, int64_t Hq,
                            int64_t Hk, int64_t D, int64_t sq, int64_t sk, int64_t sv, int64_t num_slots,
                            int64_t max_pos, int dt, float *ksc, float *vsc, int kv, int nthreads) {
    const int rc = check_rows(slots, pos, T, num_slots, max_pos);
    if (rc) return rc;
    const int par = T >= 16 && nthreads > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = T * id / nt, t1 = T * (id + 1) / nt;
        rope_any(q, k, v, pos, cs, kc, vc, slots, q_out, t0, t1, Hq, Hk, D, sq, sk, sv, dt, kv, ksc, vsc);
    }
    return 0;
}

/* ---- paged decode attention ------------------------------------------------------------------------------- */

static inline int64_t window_start(int64_t n, int64_t window) { return window > 0 && n > window ? n - window : 0; }

/* The sequences' lengths and the page ids of their (windowed) contexts checked before any key is read: 0, -1 - b
 * for sequence b longer than its table row, -1 - B - b for a page id of b's context outside [0, num_pages). */
static int check_tables(const int32_t *seq_lens, const int32_t *block_table, int64_t B, int64_t bt_stride,
                        int64_t bt_cols, int64_t num_pages, int64_t ps, int64_t window) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = seq_lens[b];
        if (n <= 0) continue;
        if (n > bt_cols * ps) return (int)(-1 - b);
        for (int64_t p = window_start(n, window) / ps; p < (n + ps - 1) / ps; p++) {
            const int32_t page = block_table[b * bt_stride + p];
            if (page < 0 || page >= num_pages) return (int)(-1 - B - b);
        }
    }
    return 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define ATT_SIMD 1
#endif

/* A decode attention's caches: their own dtype (kv 0), or 1-byte codes (kv 1 int8, 2 float8_e4m3fn) with fp32 scales
 * per (slot, KV head), ks / vs [num_pages, ps, Hk] (the AVX-512 path only) */
typedef struct {
    const float *ks, *vs;
    int kv;
} kvq_t;

#if ATT_SIMD

/* 2^x per lane (below -150: 0; above 128: inf): x = n + f, |f| <= 1/2, 2^f by its degree-7 Taylor polynomial
 * (relative error ~1e-8 over that range), times 2^n by vscalefps */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* 16 fp32 values stored as bf16 (rounded to nearest even, NaN kept: f32_to_bf16 per lane) or fp32 */
static inline void st16(void *p, int64_t i, __m512 v, const int bf) {
    if (!bf) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)))),
        16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(r));
}

/* Lane t of the result: the sum of v[t]'s 16 lanes (a transposing tree of 46 shuffles and adds for the 16) */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s8[8], s4[4];
    for (int i = 0; i < 8; i++) /* 256-bit halves: lanes 0-7 v[2i]'s 8 partial sums, 8-15 v[2i + 1]'s */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane k: v[4i + k]'s 4 partial sums */
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0xDD));
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(s4[0], s4[1]), _mm512_unpackhi_ps(s4[0], s4[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(s4[2], s4[3]), _mm512_unpackhi_ps(s4[2], s4[3]));
    const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
    /* lane 4k + m of r holds v[4m + k] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* 16 fp32 values from 16 bf16 (bf) or fp32 ones */
static inline __m512 ld16(const void *p, int64_t i, const int bf) {
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16))
              : _mm512_loadu_ps((const float *)p + i);
}

/* 16 cache values from their 1-byte codes (kv 1: int8; 2: float8_e4m3fn, its bits moved into an fp32's and scaled by
 * 2^120, exact for every finite code, subnormals included) or the cache's own dtype (kv 0: ld16) */
static inline __m512 ldc16(const void *p, int64_t i, const int bf, const int kv) {
    if (kv == 0) return ld16(p, i, bf);
    const __m128i c = _mm_loadu_si128((const __m128i *)((const uint8_t *)p + i));
    if (kv == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
    const __m512i u = _mm512_cvtepu8_epi32(c);
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), 20),
                                         _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.329227995784916e36f)); /* 2^120 */
}

/* acc[g D + d] += sum_t P[16 g + t] V_t[d] over the tile's nt keys (rows: their offsets), 16 dims at a time */
static inline __attribute__((always_inline)) void pv_tile(float *acc, const float *P, const void *vc,
                                                          const int64_t *rows, int nt, int64_t D, const int64_t G,
                                                          const int bf, const int kv) {
    for (int64_t c = 0; c < D; c += 16) {
        __m512 a[16];
        for (int64_t g = 0; g < G; g++) a[g] = _mm512_loadu_ps(acc + g * D + c);
        for (int t = 0; t < nt; t++) {
            const __m512 v = ldc16(vc, rows[t] + c, bf, kv);
            for (int64_t g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(P[16 * g + t]), v, a[g]);
        }
        for (int64_t g = 0; g < G; g++) _mm512_storeu_ps(acc + g * D + c, a[g]);
    }
}

/* silu_rows in 16 lanes: silu(g) u = g / (1 + 2^(-g log2 e)) u in fp32 (exp2_ps: within ~1e-7 of expf), rounded
 * once; the tail of d past a multiple of 16 by silu_rows */
static void silu_rows_simd(const void *x, void *out, int64_t r0, int64_t r1, int64_t d, const int bf) {
    const __m512 nl2e = _mm512_set1_ps(-1.4426950408889634f), one = _mm512_set1_ps(1.f);
    const int64_t d16 = d / 16 * 16;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t i = 0; i < d16; i += 16) {
            const __m512 g = ld16(x, r * 2 * d + i, bf), u = ld16(x, r * 2 * d + d + i, bf);
            const __m512 e = exp2_ps(_mm512_mul_ps(g, nl2e));
            st16(out, r * d + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u), bf);
        }
        if (d16 < d) {
            for (int64_t i = d16; i < d; i++) {
                const float g = ld(x, r * 2 * d + i, bf), u = ld(x, r * 2 * d + d + i, bf);
                st(out, r * d + i, g / (1.f + expf(-g)) * u, bf);
            }
        }
    }
}

/* The element offsets in the caches of the n (<= 16; none if n <= 0) keys from key0 of one KV head */
static inline void tile_rows(const int32_t *pages, int64_t ps, int64_t Hk, int64_t hk, int64_t D, int64_t key0, int n,
                             int64_t *rows) {
    for (int64_t t = 0, pg = key0 / ps, off = key0 % ps; t < n; t++) {
        rows[t] = (((int64_t)pages[pg] * ps + off) * Hk + hk) * D;
        if (++off == ps) off = 0, pg++;
    }
}

/* Software prefetch of those rows of K and V (rb bytes a row, es bytes an element) */
static inline void prefetch_rows(const void *kc, const void *vc, const int64_t *rows, int n, int64_t rb, int64_t es,
                                 const int hint) {
    for (int t = 0; t < n; t++)
        for (int64_t o = 0; o < rb; o += 64) {
            if (hint == _MM_HINT_T0) {
                _mm_prefetch((const char *)kc + rows[t] * es + o, _MM_HINT_T0);
                _mm_prefetch((const char *)vc + rows[t] * es + o, _MM_HINT_T0);
            } else {
                _mm_prefetch((const char *)kc + rows[t] * es + o, _MM_HINT_T1);
                _mm_prefetch((const char *)vc + rows[t] * es + o, _MM_HINT_T1);
            }
        }
}

/* attend() in 512-bit lanes for head dims of a multiple of 16 up to 256 and groups of up to 16 query heads, over
 * the keys [j0, j1) of the window's L = n - start (start: its first key): keys in tiles of 16, each tile's scores
 * one vector (bf16 pairs' dot products by vdpbf16ps where the host has it, else fp32 FMAs), an online softmax in
 * base 2 (running max m and sum l per query head, the sums rescaled when the max grows), V rows accumulated in fp32
 * into acc [G, D]. m / l / acc carry over from call to call (start: -inf / 0 / 0). */
static void attend_part(const void *q, const void *kc, const void *vc, const int32_t *pages, int64_t ps, int64_t Hk,
                        int64_t D, int64_t G, int64_t b, int64_t hk, int64_t start, int64_t j0, int64_t j1,
                        float scale, float *m, float *l, float *acc, const int bf, const kvq_t *kq) {
    const int64_t q0 = (b * Hk * G + hk * G) * D;
    const int kv = kq->kv;
    const __m512 sl2 = _mm512_set1_ps(scale * 1.4426950408889634f);
    float P[16 * 16];
    int64_t rows[16];
    __m512 sv[16];
#if defined(__AVX512BF16__)
    const int dp = bf && D % 32 == 0 && kv == 0;
#else
    const int dp = 0;
#endif
    const int64_t es = kv ? 1 : bf ? 2 : 4; /* bytes a cache element */
    int64_t nrows[16], frows[16];
    for (int64_t jt = j0; jt < j1; jt += 16) {
        const int nt = j1 - jt < 16 ? (int)(j1 - jt) : 16;
        const __mmask16 valid = (__mmask16)((1u << nt) - 1);
        if (jt == j0) /* the first tile's rows; later ones were found (and prefetched) a tile ahead */
            tile_rows(pages, ps, Hk, hk, D, start + jt, nt, rows);
        else
            memcpy(rows, nrows, sizeof(rows));
        float ksv[16] = {0}, vsv[16] = {0}; /* 1-byte caches: the tile's scales, [num_pages, ps, Hk] as rows / D */
        for (int t = 0; kv && t < nt; t++) ksv[t] = kq->ks[rows[t] / D], vsv[t] = kq->vs[rows[t] / D];
        /* the K and V rows of the next tile into L1 and of the one after into L2, asked of memory now: a long
         * context's caches come from DRAM once a step, in strided rows, and the tiles' arithmetic hides the wait */
        const int n1 = j1 - jt - 16 < 16 ? (int)(j1 - jt - 16) : 16, n2 = j1 - jt - 32 < 16 ? (int)(j1 - jt - 32) : 16;
        tile_rows(pages, ps, Hk, hk, D, start + jt + 16, n1, nrows);
        prefetch_rows(kc, vc, nrows, n1, D * es, es, _MM_HINT_T0);
        tile_rows(pages, ps, Hk, hk, D, start + jt + 32, n2, frows);
        prefetch_rows(kc, vc, frows, n2, D * es, es, _MM_HINT_T1);
        for (int64_t g = 0; g < G; g++) {
            for (int t = 0; t < 16; t++) {
                __m512 a = _mm512_setzero_ps();
                if (t < nt) {
#if defined(__AVX512BF16__)
                    if (dp) {
                        const uint16_t *qg = (const uint16_t *)q + q0 + g * D, *kr = (const uint16_t *)kc + rows[t];
                        for (int64_t c = 0; c < D; c += 32)
                            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(qg + c)),
                                                 (__m512bh)_mm512_loadu_si512((const void *)(kr + c)));
                    } else
#endif
                        for (int64_t c = 0; c < D; c += 16)
                            a = _mm512_fmadd_ps(ld16(q, q0 + g * D + c, bf), ldc16(kc, rows[t] + c, bf, kv), a);
                }
                sv[t] = a;
            }
            __m512 s = _mm512_mul_ps(hsum16(sv), sl2);
            if (kv) s = _mm512_mul_ps(s, _mm512_loadu_ps(ksv)); /* the keys' scales */
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
            const float mt = _mm512_reduce_max_ps(s), mn = mt > m[g] ? mt : m[g];
            const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
            if (mn > m[g]) {
                const float corr = exp2f(m[g] - mn);
                l[g] *= corr;
                const __m512 cv = _mm512_set1_ps(corr);
                for (int64_t c = 0; c < D; c += 16)
                    _mm512_storeu_ps(acc + g * D + c, _mm512_mul_ps(cv, _mm512_loadu_ps(acc + g * D + c)));
                m[g] = mn;
            }
            l[g] += _mm512_reduce_add_ps(p);
            /* the values' scales folded into the weights: sum_t p_t (s_t c_t) = sum_t (p_t s_t) c_t */
            _mm512_storeu_ps(P + 16 * g, kv ? _mm512_mul_ps(p, _mm512_loadu_ps(vsv)) : p);
        }
        switch (G) { /* the group's accumulators of 16 dims in registers across the tile */
        case 1: pv_tile(acc, P, vc, rows, nt, D, 1, bf, kv); break;
        case 2: pv_tile(acc, P, vc, rows, nt, D, 2, bf, kv); break;
        case 3: pv_tile(acc, P, vc, rows, nt, D, 3, bf, kv); break;
        case 4: pv_tile(acc, P, vc, rows, nt, D, 4, bf, kv); break;
        case 5: pv_tile(acc, P, vc, rows, nt, D, 5, bf, kv); break;
        case 6: pv_tile(acc, P, vc, rows, nt, D, 6, bf, kv); break;
        case 7: pv_tile(acc, P, vc, rows, nt, D, 7, bf, kv); break;
        case 8: pv_tile(acc, P, vc, rows, nt, D, 8, bf, kv); break;
        default: pv_tile(acc, P, vc, rows, nt, D, G, bf, kv);
        }
    }
}

/* The whole window of one (sequence, KV head) by attend_part, written to out normalized. acc: G * D floats. */
static void attend_simd(const void *q, const void *kc, const void *vc, const int32_t *pages, int64_t ps, int64_t Hk,
                        int64_t D, int64_t G, int64_t b, int64_t hk, int64_t start, int64_t L, float scale,
                        void *out, float *acc, const int bf, const kvq_t *kq) {
    float m[16], l[16];
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    attend_part(q, kc, vc, pages, ps, Hk, D, G, b, hk, start, 0, L, scale, m, l, acc, bf, kq);
    const int64_t q0 = (b * Hk * G + hk * G) * D;
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.f / l[g];
        for (int64_t i = 0; i < D; i++) st(out, q0 + g * D + i, acc[g * D + i] * inv, bf);
    }
}
#else
#define ATT_SIMD 0
#endif

/* attend_simd where it applies with att_splits' key splits (2, the default), without them (1), or the scalar loops
 * alone (0): for A/B timing; returns the setting before the call */
static int att_simd_on = ATT_SIMD ? 2 : 0;
int infercore_set_attn_simd(int mode) {
    const int before = att_simd_on;
    att_simd_on = ATT_SIMD && mode > 0 ? (mode > 2 ? 2 : mode) : 0;
    return before;
}

/* Whether attend_simd takes a (D, G) shape */
static inline int simd_shape(int64_t D, int64_t G) { return att_simd_on && D % 16 == 0 && D <= 256 && G <= 16; }

/* Key splits per (sequence, KV head) where the B Hk units are fewer than the nthreads threads (a decode step of few
 * KV heads on a many-core host: SmolLM2's 3 or Llama-3's 8 on 16 cores), so that B Hk S units give each thread one,
 * each split at least 256 keys of the longest sequence; 1: none (the vector path only). Not at units >= threads:
 * on the 2-vCPU test VM 3 units on 2 threads ran faster whole than in 6 parts (ad hoc timings, no result file). */
static int64_t att_splits(int64_t B, int64_t Hk, int64_t D, int64_t G, int64_t maxn, int nthreads) {
    if (!simd_shape(D, G) || att_simd_on < 2 || B * Hk >= nthreads) return 1;
    int64_t S = (nthreads + B * Hk - 1) / (B * Hk);
    if (S > maxn / 256) S = maxn / 256;
    return S > 1 ? S : 1;
}

/* att_splits, for the tests */
int64_t infercore_attn_splits(int64_t B, int64_t Hk, int64_t D, int64_t G, int64_t maxn, int nthreads) {
    return att_splits(B, Hk, D, G, maxn, nthreads);
}

/* floats of the split partials: per unit, m [G], l [G], acc [G, D] */
static inline int64_t part_floats(int64_t G, int64_t D) { return 2 * G + G * D; }

/* One (sequence b of length n, KV head): the G query heads of the group over its last `window` keys (all: 0), two
 * passes (scores, then the softmax-weighted sum of V); zeros where n <= 0. s: scratch of G * n floats; qf / kf /
 * acc: G * D, D and G * D floats. */
static inline __attribute__((always_inline)) void attend(const void *q, const void *kc, const void *vc,
                                                         const int32_t *pages, int64_t ps, int64_t Hk, int64_t D,
                                                         int64_t G, int64_t b, int64_t hk, int64_t window,
                                                         int64_t n, float scale, void *out, float *s, float *qf,
                                                         float *kf, float *acc, const int bf, const kvq_t *kq) {
    const int64_t Hq = Hk * G;
    if (n <= 0) {
        for (int64_t i = 0; i < G * D; i++) st(out, (b * Hq + hk * G) * D + i, 0.f, bf);
        return;
    }
    const int64_t start = window_start(n, window), L = n - start;
#if ATT_SIMD
    if (simd_shape(D, G)) {
        attend_simd(q, kc, vc, pages, ps, Hk, D, G, b, hk, start, L, scale, out, acc, bf, kq);
        return;
    }
#endif
    (void)kq; /* 1-byte caches take the vector path only (infercore_decode_attention checks) */
    for (int64_t g = 0; g < G; g++) ld_row(q, (b * Hq + hk * G + g) * D, D, qf + g * D, bf);
    for (int64_t j = 0; j < L; j++) {
        const int64_t key = start + j;
        const int64_t row = ((int64_t)pages[key / ps] * ps + key % ps) * Hk + hk;
        ld_row(kc, row * D, D, kf, bf);
        for (int64_t g = 0; g < G; g++) s[g * L + j] = dot_f32(qf + g * D, kf, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * L, m = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < L; j++) m = sg[j] > m ? sg[j] : m;
        for (int64_t j = 0; j < L; j++) {
            sg[j] = expf(sg[j] - m);
            sum += sg[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < L; j++) sg[j] *= inv;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t j = 0; j < L; j++) {
        const int64_t key = start + j;
        const int64_t row = ((int64_t)pages[key / ps] * ps + key % ps) * Hk + hk;
        ld_row(vc, row * D, D, kf, bf);
        for (int64_t g = 0; g < G; g++) {
            const float p = s[g * L + j];
            float *a = acc + g * D;
            for (int64_t i = 0; i < D; i++) a[i] += p * kf[i];
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < D; i++) st(out, (b * Hq + hk * G + g) * D + i, acc[g * D + i], bf);
}

/* The longest of the B sequence lengths (at least 1): the scores' scratch of attend is G times that. */
static int64_t max_len(const int32_t *seq_lens, int64_t B) {
    int64_t m = 1;
    for (int64_t b = 0; b < B; b++) m = seq_lens[b] > m ? seq_lens[b] : m;
    return m;
}

/* The (sequence, KV head) units of a decode step over this thread's share; buf: 3 G D + D floats, sc: G max_len. */
static inline void attend_units(const void *q, const void *kc, const void *vc, const int32_t *seq_lens,
                                const int32_t *block_table, int64_t bt_stride, int64_t B, int64_t Hk, int64_t D,
                                int64_t G, int64_t ps, float scale, int64_t window, void *out, float *buf, float *sc,
                                int dt, int64_t S, float *part, const kvq_t *kq) {
    float *qf = buf, *acc = qf + G * D, *kf = acc + G * D;
#if ATT_SIMD
    if (S > 1) { /* att_splits' key splits: partials into part, then merged per (sequence, KV head) */
        const int64_t pf = part_floats(G, D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < B * Hk * S; u++) {
            const int64_t b = u / (Hk * S), hk = u / S % Hk, sp = u % S, n = seq_lens[b];
            float *m = part + u * pf, *l = m + G, *a = l + G;
            for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
            memset(a, 0, (size_t)(G * D) * sizeof(float));
            if (n <= 0) continue;
            const int64_t start = window_start(n, window), L = n - start;
            const int64_t chunk = ((L + S - 1) / S + 15) / 16 * 16, j0 = sp * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
            if (j0 < j1)
                attend_part(q, kc, vc, block_table + b * bt_stride, ps, Hk, D, G, b, hk, start, j0, j1, scale, m, l, a,
                            dt, kq);
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < B * Hk; u++) {
            const int64_t b = u / Hk, q0 = (b * Hk * G + u % Hk * G) * D;
            const float *p0 = part + u * S * pf;
            for (int64_t g = 0; g < G; g++) {
                float M = -INFINITY, sum = 0.f;
                for (int64_t sp = 0; sp < S; sp++) M = p0[sp * pf + g] > M ? p0[sp * pf + g] : M;
                memset(acc, 0, (size_t)D * sizeof(float));
                for (int64_t sp = 0; sp < S && M > -INFINITY; sp++) {
                    const float *ps_ = p0 + sp * pf;
                    if (ps_[g] == -INFINITY) continue;
                    const float w = exp2f(ps_[g] - M);
                    sum += w * ps_[G + g];
                    for (int64_t i = 0; i < D; i++) acc[i] += w * ps_[2 * G + g * D + i];
                }
                const float inv = sum > 0.f ? 1.f / sum : 0.f; /* a sequence of length <= 0: zeros */
                for (int64_t i = 0; i < D; i++) st(out, q0 + g * D + i, acc[i] * inv, dt);
            }
        }
        return;
    }
#else
    (void)S, (void)part;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < B * Hk; u++) {
        const int64_t b = u / Hk, hk = u % Hk;
        const int32_t *pages = block_table + b * bt_stride;
        if (dt)
            attend(q, kc, vc, pages, ps, Hk, D, G, b, hk, window, seq_lens[b], scale, out, sc, qf, kf, acc, 1, kq);
        else
            attend(q, kc, vc, pages, ps, Hk, D, G, b, hk, window, seq_lens[b], scale, out, sc, qf, kf, acc, 0, kq);
    }
}

/* Whether decode attention reads 1-byte caches (the vector path) at head dim D and group G */
int infercore_att_codes_ok(int64_t D, int64_t G) { return simd_shape(D, G); }

/* q [B, Hq, D]; caches [num_pages, ps, Hk, D] of q's dtype (kv 0), or 1-byte codes (kv 1 int8, 2 float8_e4m3fn) with
 * fp32 scales ksc / vsc [num_pages, ps, Hk]; seq_lens int32 [B]; block_table int32 [B, bt_stride] with bt_cols
 * columns in use; window 0 = none; out [B, Hq, D]. Sequences of length <= 0 get zeros. Returns check_tables' code
 * (nothing read if < 0), or 1 (nothing read) for 1-byte caches of a shape the vector path does not take. */
int infercore_decode_attention(const void *q, const void *kc, const void *vc, const int32_t *seq_lens,
                               const int32_t *block_table, int64_t bt_stride, int64_t bt_cols, int64_t num_pages,
                               int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t ps, float scale, int64_t window,
                               void *out, int dt, const float *ksc, const float *vsc, int kv, int nthreads) {
    const int64_t G = Hq / Hk, maxn = max_len(seq_lens, B);
    if (kv && !simd_shape(D, G)) return 1; /* 1-byte caches: the vector path only; nothing read */
    const int rc = check_tables(seq_lens, block_table, B, bt_stride, bt_cols, num_pages, ps, window);
    if (rc) return rc;
    const kvq_t kq = {ksc, vsc, kv};
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b] > 0 ? seq_lens[b] : 0;
    /* by the longest sequence, window or not: the fused layers (step_alloc) split alike, so they keep its results */
    const int64_t S = att_splits(B, Hk, D, G, maxn, nthreads);
    const int par = work * Hk >= 256 && nthreads > 1 && B * Hk * S > 1;
    float *part = S > 1 ? (float *)malloc((size_t)(B * Hk * S * part_floats(G, D)) * sizeof(float)) : 0;
    const int nt = B * Hk * S < nthreads ? (int)(B * Hk * S) : nthreads; /* no more threads than units */
#pragma omp parallel num_threads(par ? nt : 1)
    {
        float *buf = (float *)malloc((size_t)(3 * G * D + D) * sizeof(float));
        float *sc = simd_shape(D, G) ? 0 : (float *)malloc((size_t)(G * maxn) * sizeof(float)); /* scalar loops' */
        attend_units(q, kc, vc, seq_lens, block_table, bt_stride, B, Hk, D, G, ps, scale, window, out, buf, sc, dt, S,
                     part, &kq);
        free(sc);
        free(buf);
    }
    free(part);
    return 0;
}

/* ---- a Llama decoder layer at decode, in one call ----------------------------------------------------------- */

void infercore_gemv_range(const void *x, int64_t M, int64_t K, const void *w, int64_t r0, int64_t r1, void *y,
                          int64_t ldy, int dt);

#define GEMV_RB 16 /* weight rows per work unit, as the standalone GEMVs */

static inline void gemv_par(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int dt) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (N + GEMV_RB - 1) / GEMV_RB; b++)
        infercore_gemv_range(x, M, K, w, b * GEMV_RB, (b + 1) * GEMV_RB < N ? (b + 1) * GEMV_RB : N, y, N, dt);
}

void infercore_act_prep(const uint16_t *x, int64_t M, int64_t K, int64_t g, int a8, float *out);
int infercore_a8_active(void);
void infercore_q4_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                        const float *sums, int64_t r0, int64_t r1, uint16_t *y, int64_t ldy);
void infercore_q8_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, int64_t g,
                        const float *sums, int64_t r0, int64_t r1, uint16_t *y, int64_t ldy);
void infercore_q5_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *sz, const float *sums,
                        int64_t r0, int64_t r1, uint16_t *y, int64_t ldy);

/* Flags in a quantized linear's g: Q5F | 32, 5-bit codes in groups of 32 (infercore_q5_range); KF, sz in the
 * two-level form of the GGUF K-quants (passed on with g: the ranges take it) */
#define Q5F ((int64_t)1 << 16)
#define KF ((int64_t)1 << 20)
#define A8F ((int64_t)1 << 21) /* INT4 / INT8 rows against 8-bit activations (infercore_set_a8) */
#define FP8F ((int64_t)1 << 22) /* FP8F | blk: e4m3 codes [N, K], fp32 scales per row (blk 0) or 128 x 128 block */
#define LUT4F ((int64_t)1 << 23) /* LUT4F | bs: 4-bit codebook codes [N, K / 2], sz = the codebook then absmax */
void infercore_lut4_prep(const uint16_t *x, int64_t M, int64_t K, float *xs);
void infercore_lut4_range(const float *xs, int64_t M, int64_t K, const uint8_t *w, const float *lutabs, int64_t bs,
                          int64_t r0, int64_t r1, uint16_t *y, int64_t ldy);
void infercore_fp8_range(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const float *scales, int64_t blk,
                         int64_t r0, int64_t r1, uint16_t *y, int64_t ldy);

static inline int64_t group_of(int64_t g) { return (g > 0 ? g : -g) & (Q5F - 1); }

/* y [M, N] = x [M, K] @ w^T for one linear of the fused layer, L = {weight, sz, g, Kp}: dense rows [N, K] of the
 * layer's dtype (g = 0); INT4 codes [N, Kp / 2] in groups of g with sz fp32 [N, 2, Kp / g] (bf16 only); 5-bit codes
 * (g = Q5F + 32: the INT4 layout, sz [N, 3, Kp / 32]); or INT8 codes [N, Kp] in groups of -g with sz fp32
 * [N, 2, Kp / -g] (g < 0, bf16 only); or e4m3 codes [N, K] with fp32 scales (g = FP8F | 0 or 128, bf16 only,
 * infercore_fp8_range); or 4-bit codebook codes [N, K / 2] with sz = the codebook then absmax (g = LUT4F | blocksize,
 * bf16 only, infercore_lut4_range; the split activations in sums [M, K]). INT4 / INT8 / 5-bit: rows zero-padded from K
 * to Kp in xp [M, Kp], their group sums in sums [M, Kp / |g|], both the calling thread's own (each thread prepares
 * them itself: no barrier before the rows); infercore_linear_q4 / _q8's values. Ends with the omp for's barrier. */
static void lin_par(const void *x, int64_t M, int64_t K, const int64_t *L, int64_t N, void *y, int dt, uint16_t *xp,
                    float *sums) {
    if (L[2] == 0) {
        gemv_par(x, M, K, (const void *)L[0], N, y, dt);
        return;
    }
    if (L[2] > 0 && (L[2] & LUT4F)) { /* bf16 only; the thread's own split fp32 activations in sums [M, K] */
        infercore_lut4_prep((const uint16_t *)x, M, K, sums);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (N + GEMV_RB - 1) / GEMV_RB; b++)
            infercore_lut4_range(sums, M, K, (const uint8_t *)L[0], (const float *)L[1], L[2] & ~LUT4F, b * GEMV_RB,
                                 (b + 1) * GEMV_RB < N ? (b + 1) * GEMV_RB : N, (uint16_t *)y, N);
        return;
    }
    if (L[2] > 0 && (L[2] & FP8F)) { /* bf16 only; no padding, no group sums (INT8's g is negative) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (N + GEMV_RB - 1) / GEMV_RB; b++)
            infercore_fp8_range((const uint16_t *)x, M, K, (const uint8_t *)L[0], (const float *)L[1], L[2] & ~FP8F,
                                b * GEMV_RB, (b + 1) * GEMV_RB < N ? (b + 1) * GEMV_RB : N, (uint16_t *)y, N);
        return;
    }
    const int64_t g = L[2], kp = L[3];
    const uint16_t *xs = kp == K ? (const uint16_t *)x : xp;
    if (kp != K)
        for (int64_t t = 0; t < M; t++) {
            memcpy(xp + t * kp, (const uint16_t *)x + t * K, 2 * (size_t)K);
            memset(xp + t * kp + K, 0, 2 * (size_t)(kp - K));
        }
    /* INT4 and INT8 linears (INT8: Kp a multiple of 64) take 8-bit activations where they are switched on (read
     * once a linear): their rows' group sums then followed by the 8-bit rows (infercore_act_prep) */
    const int a8 = (g > 0 ? !(g & Q5F) : kp % 64 == 0) && infercore_a8_active();
    infercore_act_prep(xs, M, kp, group_of(g), a8, sums);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (N + GEMV_RB - 1) / GEMV_RB; b++) {
        const int64_t r1 = (b + 1) * GEMV_RB < N ? (b + 1) * GEMV_RB : N;
        if (g > 0 && (g & Q5F))
            infercore_q5_range(xs, M, kp, (const uint8_t *)L[0], (const float *)L[1], sums, b * GEMV_RB, r1,
                               (uint16_t *)y, N);
        else if (g > 0)
            infercore_q4_range(xs, M, kp, (const uint8_t *)L[0], (const float *)L[1], a8 ? g | A8F : g, sums,
                               b * GEMV_RB, r1,
                               (uint16_t *)y, N);
        else
            infercore_q8_range(xs, M, kp, (const uint8_t *)L[0], (const float *)L[1], a8 ? -g | A8F : -g, sums,
                               b * GEMV_RB, r1,
                               (uint16_t *)y, N);
    }
}

/* The shapes of a decode step through decoder layers, and the buffers the threads share (the linears' outputs,
 * q / k / v, attention) */
typedef struct {
    int64_t T, H, Hq, Hk, D, I, ps, bt_stride;
    const int64_t *pos;
    const float *cs;
    const int32_t *slots, *seq_lens, *block_table;
    float scale;
    int dt;
    char *qkv, *qr, *attn, *o, *h;
    int64_t S;  /* attention's key splits (att_splits) */
    float *part; /* their partials */
} step_t;

/* What each thread keeps for itself: the normed rows xn [T, H], a residual rs [T, H], the activation act [T, I],
 * padded rows xp and group sums of the quantized linears, attention scratch (buf, sc) */
typedef struct {
    char *xn, *rs, *act;
    uint16_t *xp;
    float *sums, *buf, *sc;
} own_t;

static void step_alloc(step_t *s, int nthreads) {
    const size_t es = s->dt ? 2 : 4;
    const int64_t T = s->T, NQ = s->Hq * s->D, NKV = s->Hk * s->D, NQKV = NQ + 2 * NKV, G = s->Hq / s->Hk;
    s->S = att_splits(T, s->Hk, s->D, G, max_len(s->seq_lens, T), nthreads);
    s->part = s->S > 1 ? (float *)malloc((size_t)(T * s->Hk * s->S * part_floats(G, s->D)) * sizeof(float)) : 0;
    s->qkv = (char *)malloc(es * (size_t)T * (size_t)(NQKV + 2 * NQ + s->H + 2 * s->I));
    s->qr = s->qkv + es * T * NQKV;
    s->attn = s->qr + es * T * NQ;
    s->o = s->attn + es * T * NQ;
    s->h = s->o + es * T * s->H;
}

/* kpmax / gsums: the largest padded K and group count over the layers' quantized linears */
static void own_alloc(own_t *w, const step_t *s, int64_t kpmax, int64_t gsums) {
    const size_t es = s->dt ? 2 : 4;
    const int64_t G = s->Hq / s->Hk, maxn = max_len(s->seq_lens, s->T), H = s->H;
    w->xn = (char *)malloc(es * (size_t)(s->T * (2 * H + s->I)));
    w->rs = w->xn + es * s->T * H;
    w->act = w->rs + es * s->T * H;
    w->xp = (uint16_t *)malloc(2 * (size_t)(s->T * kpmax) + 2);
    w->sums = (float *)malloc(4 * (size_t)(s->T * gsums) + 4);
    w->buf = (float *)malloc((size_t)(H > 3 * G * s->D + s->D ? H : 3 * G * s->D + s->D) * sizeof(float));
    w->sc = simd_shape(s->D, G) ? 0 : (float *)malloc((size_t)(G * maxn) * sizeof(float)); /* the scalar loops' */
}

static void own_free(own_t *w) {
    free(w->sc);
    free(w->buf);
    free(w->sums);
    free(w->xp);
    free(w->xn);
}

static void quant_sizes(const int64_t *lin, int64_t *kpmax, int64_t *gsums) {
    for (int l = 0; l < 4; l++) {
        if (lin[4 * l + 2] > 0 && (lin[4 * l + 2] & LUT4F)) /* the split activations: K floats a row */
            *gsums = lin[4 * l + 3] > *gsums ? lin[4 * l + 3] : *gsums;
        if (lin[4 * l + 2] && !(lin[4 * l + 2] > 0 && (lin[4 * l + 2] & (FP8F | LUT4F)))) {
            *kpmax = lin[4 * l + 3] > *kpmax ? lin[4 * l + 3] : *kpmax;
            /* the group sums, and room for 8-bit activations (infercore_act_prep: Kp / 2 floats more) */
            const int64_t ng = lin[4 * l + 3] / group_of(lin[4 * l + 2]) + lin[4 * l + 3] / 2;
            *gsums = ng > *gsums ? ng : *gsums;
        }
    }
}

/* One decoder layer, run by every thread of the enclosing parallel region (see infercore_llama_decode_layer). The
 * norms, SiLU and the quantized linears' group sums are small: each thread computes them itself, the same values,
 * so only the linears, RoPE with the KV write and attention need barriers (six a layer). Thread 0 writes the
 * shared residual; it writes the second one after the gate_up rows, whose barrier follows every thread's read of
 * the first. */
#define LORA_TAB 28 /* int64 per layer of the LoRA operands: qkv, o, gate_up, down, 7 each (lora_rows' d) */

/* LoRA of one projection inside the fused layer (one thread: run it in an omp single): d = {a, b, R, r, b0, b1, b2}
 * as infercore_lora_apply takes them (a == 0: the projection has none), slots int64 [T] */
static void lora_rows(const void *x, void *y, int64_t T, int64_t K, int64_t N, const int64_t *d, const int64_t *slots,
                      int dt) {
    if (d[0])
        infercore_lora_apply(x, y, (const float *)d[0], (const float *)d[1], slots, T, K, N, d[2], d[3], d[4], d[5],
                             d[6], dt, 1);
}

static void layer_body(const step_t *s, own_t *w, const void *x, const void *res, void *res_out, void *out,
                       const void *n1, float eps1, const int64_t *lin, void *kc, void *vc, int64_t window,
                       const void *n2, float eps2, const kvq_t *kq, const void *qn, const void *kn, float qk_eps,
                       const void *qb, const int64_t *lt, const int64_t *lslots) {
    const int id = omp_get_thread_num(), dt = s->dt;
    const int64_t T = s->T, H = s->H, D = s->D, NQ = s->Hq * D, NKV = s->Hk * D, NQKV = NQ + 2 * NKV;
    const size_t es = dt ? 2 : 4;
    if (res == 0) {
        if (id == 0) memcpy(res_out, x, es * T * H);
        rms_any(x, 0, 0, n1, w->xn, 0, T, H, eps1, 0.f, dt, dt, w->buf);
    } else {
        rms_any(x, res, id == 0 ? res_out : w->rs, n1, w->xn, 0, T, H, eps1, 0.f, dt, dt, w->buf);
    }
    lin_par(w->xn, T, H, lin, NQKV, s->qkv, dt, w->xp, w->sums);
#pragma omp single
    {
        if (qb) /* qkv's bias [NQKV] (Qwen2), added to the rounded product in fp32 and rounded, as the linears do */
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < NQKV; i++)
                    st(s->qkv, t * NQKV + i, ld(s->qkv, t * NQKV + i, dt) + ld(qb, i, dt), dt);
        if (lt) lora_rows(w->xn, s->qkv, T, H, NQKV, lt, lslots, dt); /* after the bias: as the op-by-op path */
        if (qn) /* Qwen3: each head of q and k RMS-normed over D (weights qn / kn [D]) in place, before RoPE */
            for (int64_t t = 0; t < T; t++) {
                char *row = s->qkv + es * t * NQKV;
                rms_any(row, 0, 0, qn, row, 0, s->Hq, D, qk_eps, 0.f, dt, dt, w->buf);
                rms_any(row + es * NQ, 0, 0, kn, row + es * NQ, 0, s->Hk, D, qk_eps, 0.f, dt, dt, w->buf);
            }
        rope_any(s->qkv, s->qkv + es * NQ, s->qkv + es * (NQ + NKV), s->pos, s->cs, kc, vc, s->slots, s->qr, 0, T,
                 s->Hq, s->Hk, D, NQKV, NQKV, NQKV, dt, kq->kv, (float *)kq->ks, (float *)kq->vs); /* in place */
    }
    attend_units(s->qr, kc, vc, s->seq_lens, s->block_table, s->bt_stride, T, s->Hk, D, s->Hq / s->Hk, s->ps,
                 s->scale, window, s->attn, w->buf, w->sc, dt, s->S, s->part, kq);
    lin_par(s->attn, T, NQ, lin + 4, H, s->o, dt, w->xp, w->sums);
    if (lt) {
#pragma omp single
        lora_rows(s->attn, s->o, T, NQ, H, lt + 7, lslots, dt);
    }
    rms_any(s->o, res_out, w->rs, n2, w->xn, 0, T, H, eps2, 0.f, dt, dt, w->buf);
    lin_par(w->xn, T, H, lin + 8, 2 * s->I, s->h, dt, w->xp, w->sums);
    if (lt) {
#pragma omp single
        lora_rows(w->xn, s->h, T, H, 2 * s->I, lt + 14, lslots, dt);
    }
    if (id == 0) memcpy(res_out, w->rs, es * T * H);
    silu_any(s->h, w->act, 0, T, s->I, dt);
    lin_par(w->act, T, s->I, lin + 12, H, out, dt, w->xp, w->sums);
    if (lt) {
#pragma omp single
        lora_rows(w->act, out, T, s->I, H, lt + 21, lslots, dt);
    }
}

/*
 * What models/llama.py's LlamaDecoderLayer computes for T decode rows (one per sequence), each step rounded to the
 * dtype where the op-by-op path rounds, with the same kernels: so the same values bit for bit, in one OpenMP
 * region instead of ~12 Python-level calls.
 *   x [T, H]; res [T, H] or NULL (first layer: the residual is x); res_out [T, H]: the residual after both adds
 *   (not aliasing x / res); out [T, H]: the MLP's output. Norm weights (dt) n1 / n2 [H]; the linears lin [4][4],
 *   each {weight, sz, g, Kp} as lin_par takes it: qkv [(Hq + 2 Hk) D, H], o [H, Hq D], gu [2 I, H], down [H, I].
 *   pos int64 [T]; cs fp32 [max_pos, D]; caches [num_pages, ps, Hk, D] of the dtype (kv 0) or of 1-byte codes (kv
 *   1 int8, 2 float8_e4m3fn; ksc / vsc fp32 [num_pages, ps, Hk]: rope_rows quantizes the new rows, the attention
 *   reads the codes); qn / kn [D] (dt) or NULL: Qwen3's RMSNorm of each q / k head (epsilon qk_eps) before RoPE;
 *   qkv_bias [(Hq + 2 Hk) D] (dt) or NULL: Qwen2's bias of the qkv projection;
 *   lt [LORA_TAB] or NULL: each projection's LoRA (lora_rows' operands; a 0 pointer: none), applied after it with the
 *   adapter slot of each row from lslots int64 [T] (-1: none), as lora.LoRALinear adds it;
 *   slots / seq_lens int32 [T]; block_table
 *   int32 [T, bt_stride] with bt_cols columns in use.
 * Returns 0, or before writing anything: -1 - t (slot t out of range), -1 - T - t (position t), -1 - 2T - t
 * (sequence t longer than its table row), -1 - 3T - t (a page id of sequence t out of range), 1 (1-byte caches at a
 * shape infercore_att_codes_ok refuses).
 */
int infercore_llama_decode_layer(const void *x, const void *res, void *res_out, void *out, int64_t T, int64_t H,
                                 const void *n1, float eps1, const int64_t *lin, int64_t Hq, int64_t Hk, int64_t D,
                                 const int64_t *pos, const float *cs, int64_t max_pos, void *kc, void *vc,
                                 int64_t num_pages, int64_t ps, const int32_t *slots, const int32_t *seq_lens,
                                 const int32_t *block_table, int64_t bt_stride, int64_t bt_cols, float scale,
                                 int64_t window, const void *n2, float eps2, int64_t I, int dt, const float *ksc,
                                 const float *vsc, int kv, const void *qn, const void *kn, float qk_eps,
                                 const void *qkv_bias, int nthreads, const int64_t *lt, const int64_t *lslots) {
    if (kv && !simd_shape(D, Hq / Hk)) return 1; /* 1-byte caches: the vector attention only; nothing written */
    int rc = check_rows(slots, pos, T, num_pages * ps, max_pos);
    if (rc) return rc;
    rc = check_tables(seq_lens, block_table, T, bt_stride, bt_cols, num_pages, ps, window);
    if (rc) return (int)(rc - 2 * T); /* -1 - 2T - t / -1 - 3T - t */
    step_t s = {T, H, Hq, Hk, D, I, ps, bt_stride, pos, cs, slots, seq_lens, block_table, scale,
                dt, 0, 0, 0, 0, 0, 1, 0};
    step_alloc(&s, nthreads);
    int64_t kpmax = 0, gsums = 0;
    quant_sizes(lin, &kpmax, &gsums);
#pragma omp parallel num_threads(nthreads)
    {
        own_t w;
        own_alloc(&w, &s, kpmax, gsums);
        const kvq_t kq = {ksc, vsc, kv};
        layer_body(&s, &w, x, res, res_out, out, n1, eps1, lin, kc, vc, window, n2, eps2, &kq, qn, kn, qk_eps,
                   qkv_bias, lt, lslots);
        own_free(&w);
    }
    free(s.qkv);
    free(s.part);
    return 0;
}

/*
 * L such decoder layers in a row (the whole stack of a decode step), the output and residual of each the next
 * one's input, through two buffers in turn; the last layer writes out / res_out. Per layer l, tab[LAYER_TAB * l ..]:
 * {n1, n2, k cache, v cache, window, lin[16], k scales, v scales, kv, q norm, k norm, qkv bias} (pointers as int64;
 * lin, the scales, kv, the q / k norms and the bias (0: none) as infercore_llama_decode_layer takes them),
 * eps[3 l], eps[3 l + 1] the two norms' epsilons, eps[3 l + 2] the q / k norms'. The caches all [num_pages, ps, Hk, D]. Every layer's indices are
 * checked before the first one runs, so an error (the return codes of infercore_llama_decode_layer) writes nothing.
 * One parallel region for the whole stack.
 */
#define LAYER_TAB 27
int infercore_llama_decode_layers(int64_t L, const int64_t *tab, const float *eps, const void *x, const void *res,
                                  void *res_out, void *out, int64_t T, int64_t H, int64_t Hq, int64_t Hk, int64_t D,
                                  const int64_t *pos, const float *cs, int64_t max_pos, int64_t num_pages, int64_t ps,
                                  const int32_t *slots, const int32_t *seq_lens, const int32_t *block_table,
                                  int64_t bt_stride, int64_t bt_cols, float scale, int64_t I, int dt, int nthreads,
                                  const int64_t *ltab, const int64_t *lslots) {
    int rc = check_rows(slots, pos, T, num_pages * ps, max_pos);
    if (rc) return rc;
    int64_t kpmax = 0, gsums = 0;
    for (int64_t l = 0; l < L; l++) { /* the windows may differ from layer to layer */
        if (tab[LAYER_TAB * l + 23] && !simd_shape(D, Hq / Hk)) return 1; /* as infercore_llama_decode_layer */
        rc = check_tables(seq_lens, block_table, T, bt_stride, bt_cols, num_pages, ps, tab[LAYER_TAB * l + 4]);
        if (rc) return (int)(rc - 2 * T);
        quant_sizes(tab + LAYER_TAB * l + 5, &kpmax, &gsums);
    }
    step_t s = {T, H, Hq, Hk, D, I, ps, bt_stride, pos, cs, slots, seq_lens, block_table, scale,
                dt, 0, 0, 0, 0, 0, 1, 0};
    step_alloc(&s, nthreads);
    const size_t es = dt ? 2 : 4, n = es * (size_t)(T * H);
    char *buf = (char *)malloc(4 * n);
#pragma omp parallel num_threads(nthreads)
    {
        own_t w;
        own_alloc(&w, &s, kpmax, gsums);
        const void *xi = x, *ri = res;
        for (int64_t l = 0; l < L; l++) {
            const int64_t *t = tab + LAYER_TAB * l;
            const int last = l == L - 1;
            void *xo = last ? out : buf + (l % 2) * 2 * n, *ro = last ? res_out : buf + (l % 2) * 2 * n + n;
            const kvq_t kq = {(const float *)t[21], (const float *)t[22], (int)t[23]};
            layer_body(&s, &w, xi, ri, ro, xo, (const void *)t[0], eps[3 * l], t + 5, (void *)t[2], (void *)t[3],
                       t[4], (const void *)t[1], eps[3 * l + 1], &kq, (const void *)t[24], (const void *)t[25],
                       eps[3 * l + 2], (const void *)t[26], ltab ? ltab + LORA_TAB * l : 0, lslots);
            xi = xo;
            ri = ro;
        }
        own_free(&w);
    }
    free(buf);
    free(s.qkv);
    free(s.part);
    return 0;
}
