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
        if (dt && wdt)
            rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 1, 1, buf);
        else if (dt)
            rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 1, 0, buf);
        else if (wdt)
            rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 0, 1, buf);
        else
            rms_rows(x, res, res_out, w, out, r0, r1, D, eps, offset, 0, 0, buf);
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

/* out [T, d] = silu(x[:, :d]) * x[:, d:] in fp32, rounded once */
void infercore_silu_and_mul(const void *x, void *out, int64_t T, int64_t d, int dt, int nthreads) {
    const int par = T * d >= 65536 && nthreads > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t r0 = T * id / nt, r1 = T * (id + 1) / nt;
        if (dt)
            silu_rows(x, out, r0, r1, d, 1);
        else
            silu_rows(x, out, r0, r1, d, 0);
    }
}

/* ---- RoPE (neox, full rotary) with the KV-cache write ----------------------------------------------------- */

static inline __attribute__((always_inline)) void rope_rows(const void *q, const void *k, const void *v,
                                                            const int64_t *pos, const float *cs,
                                                            void *kc, void *vc, const int32_t *slots,
                                                            void *q_out, int64_t t0, int64_t t1, int64_t Hq,
                                                            int64_t Hk, int64_t D, const int bf) {
    const int64_t half = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *cos = cs + pos[t] * D, *sin = cos + half;
        const int store = slots[t] >= 0; /* slot -1: the row's K/V are not stored */
        for (int64_t h = 0; h < (store ? Hq + Hk : Hq); h++) {
            const void *src = h < Hq ? q : k;
            const int64_t si = h < Hq ? (t * Hq + h) * D : (t * Hk + h - Hq) * D;
            void *dst = h < Hq ? q_out : kc;
            const int64_t di = h < Hq ? si : ((int64_t)slots[t] * Hk + h - Hq) * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = ld(src, si + i, bf), x2 = ld(src, si + half + i, bf);
                st(dst, di + i, x1 * cos[i] - x2 * sin[i], bf);
                st(dst, di + half + i, x2 * cos[i] + x1 * sin[i], bf);
            }
        }
        const size_t vb = (size_t)(Hk * D) * (bf ? 2 : 4);
        if (store) memcpy((char *)vc + (size_t)slots[t] * vb, (const char *)v + (size_t)t * vb, vb);
    }
}

/* q [T, Hq, D], k / v [T, Hk, D] (contiguous); pos int64 [T] in [0, max_pos); cs fp32 [max_pos, D] = [cos | sin];
 * caches [num_slots = pages * page_size, Hk, D] of the same dtype; slots int32 [T] in [0, num_slots). q_out
 * [T, Hq, D] gets rotated q. Returns 0, or (before writing anything) -1 - t for a slot out of range at row t,
 * -1 - T - t for a position out of range. */
int infercore_rope_write_kv(const void *q, const void *k, const void *v, const int64_t *pos, const float *cs,
                            void *kc, void *vc, const int32_t *slots, void *q_out, int64_t T, int64_t Hq,
                            int64_t Hk, int64_t D, int64_t num_slots, int64_t max_pos, int dt, int nthreads) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return (int)(-1 - t);
        if (pos[t] < 0 || pos[t] >= max_pos) return (int)(-1 - T - t);
    }
    const int par = T >= 16 && nthreads > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = T * id / nt, t1 = T * (id + 1) / nt;
        if (dt)
            rope_rows(q, k, v, pos, cs, kc, vc, slots, q_out, t0, t1, Hq, Hk, D, 1);
        else
            rope_rows(q, k, v, pos, cs, kc, vc, slots, q_out, t0, t1, Hq, Hk, D, 0);
    }
    return 0;
}

/* ---- paged decode attention ------------------------------------------------------------------------------- */

/* One (sequence, KV head): the G query heads of the group over keys [start, n), two passes (scores, then the
 * softmax-weighted sum of V). s: scratch of G * (n - start) floats; qf / kf: G * D and D floats. */
static inline __attribute__((always_inline)) void attend(const void *q, const void *kc, const void *vc,
                                                         const int32_t *pages, int64_t ps, int64_t Hk, int64_t D,
                                                         int64_t G, int64_t b, int64_t hk, int64_t start,
                                                         int64_t n, float scale, void *out, float *s, float *qf,
                                                         float *kf, float *acc, const int bf) {
    const int64_t L = n - start, Hq = Hk * G;
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

/* q [B, Hq, D]; caches [num_pages, ps, Hk, D]; seq_lens int32 [B]; block_table int32 [B, bt_stride] with
 * bt_cols columns in use; window 0 = none; out [B, Hq, D]. Sequences of length <= 0 get zeros. Returns 0, or
 * (before reading any key) -1 - b for sequence b longer than its table row, -1 - B - b for a page id of b's context
 * outside [0, num_pages). */
int infercore_decode_attention(const void *q, const void *kc, const void *vc, const int32_t *seq_lens,
                               const int32_t *block_table, int64_t bt_stride, int64_t bt_cols, int64_t num_pages,
                               int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t ps, float scale, int64_t window,
                               void *out, int dt, int nthreads) {
    const int64_t G = Hq / Hk;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = seq_lens[b];
        if (n <= 0) continue;
        if (n > bt_cols * ps) return (int)(-1 - b);
        const int64_t start = window > 0 && n > window ? n - window : 0;
        for (int64_t p = start / ps; p < (n + ps - 1) / ps; p++) {
            const int32_t page = block_table[b * bt_stride + p];
            if (page < 0 || page >= num_pages) return (int)(-1 - B - b);
        }
        work += n;
    }
    const int par = work * Hk >= 256 && nthreads > 1 && B * Hk > 1;
#pragma omp parallel num_threads(par ? nthreads : 1)
    {
        float *qf = (float *)malloc((size_t)(3 * G * D + D) * sizeof(float));
        float *acc = qf + G * D, *kf = acc + G * D;
        float *s = 0;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < B * Hk; u++) {
            const int64_t b = u / Hk, hk = u % Hk, n = seq_lens[b];
            if (n <= 0) {
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < D; i++) st(out, (b * Hq + hk * G + g) * D + i, 0.f, dt);
                continue;
            }
            const int64_t start = window > 0 && n > window ? n - window : 0;
            if (G * (n - start) > cap) {
                free(s);
                cap = G * (n - start);
                s = (float *)malloc((size_t)cap * sizeof(float));
            }
            const int32_t *pages = block_table + b * bt_stride;
            if (dt)
                attend(q, kc, vc, pages, ps, Hk, D, G, b, hk, start, n, scale, out, s, qf, kf, acc, 1);
            else
                attend(q, kc, vc, pages, ps, Hk, D, G, b, hk, start, n, scale, out, s, qf, kf, acc, 0);
        }
        free(s);
        free(qf);
    }
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

/*
 * What models/llama.py's LlamaDecoderLayer computes for T decode rows (one per sequence), each step rounded to the
 * dtype where the op-by-op path rounds, with the same kernels: so the same values bit for bit, in one OpenMP
 * region instead of ~12 Python-level calls.
 *   x [T, H]; res [T, H] or NULL (first layer: the residual is x); res_out [T, H]: the residual after both adds;
 *   out [T, H]: the MLP's output. Weights (dt, contiguous): n1 / n2 [H], qkv [(Hq + 2 Hk) D, H], o [H, Hq D],
 *   gu [2 I, H], down [H, I]. pos int64 [T]; cs fp32 [max_pos, D]; caches [num_pages, ps, Hk, D]; slots /
 *   seq_lens int32 [T]; block_table int32 [T, bt_stride] with bt_cols columns in use.
 * Returns 0, or before writing anything: -1 - t (slot t out of range), -1 - T - t (position t), -1 - 2T - t
 * (sequence t longer than its table row), -1 - 3T - t (a page id of sequence t out of range).
 */
int infercore_llama_decode_layer(const void *x, const void *res, void *res_out, void *out, int64_t T, int64_t H,
                                 const void *n1, float eps1, const void *qkv_w, int64_t Hq, int64_t Hk, int64_t D,
                                 const int64_t *pos, const float *cs, int64_t max_pos, void *kc, void *vc,
                                 int64_t num_pages, int64_t ps, const int32_t *slots, const int32_t *seq_lens,
                                 const int32_t *block_table, int64_t bt_stride, int64_t bt_cols, float scale,
                                 int64_t window, const void *o_w, const void *n2, float eps2, const void *gu_w,
                                 int64_t I, const void *down_w, int dt, int nthreads) {
    const int64_t num_slots = num_pages * ps, NQ = Hq * D, NKV = Hk * D, NQKV = NQ + 2 * NKV, G = Hq / Hk;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < -1 || slots[t] >= num_slots) return (int)(-1 - t); /* -1: not stored, as the op-by-op path */
        if (pos[t] < 0 || pos[t] >= max_pos) return (int)(-1 - T - t);
        const int64_t n = seq_lens[t];
        if (n <= 0) continue;
        if (n > bt_cols * ps) return (int)(-1 - 2 * T - t);
        const int64_t start = window > 0 && n > window ? n - window : 0;
        for (int64_t p = start / ps; p < (n + ps - 1) / ps; p++) {
            const int32_t page = block_table[t * bt_stride + p];
            if (page < 0 || page >= num_pages) return (int)(-1 - 3 * T - t);
        }
    }
    const size_t es = dt ? 2 : 4;
    int64_t maxn = 1;
    for (int64_t t = 0; t < T; t++) maxn = seq_lens[t] > maxn ? seq_lens[t] : maxn;
    /* activations: xn [T, H], qkv [T, NQKV], q / k / v split [T, NQKV], q_rot [T, NQ], attn [T, NQ], o [T, H],
     * h [T, 2I], act [T, I] */
    char *ws = (char *)malloc(es * (size_t)T * (size_t)(2 * H + 2 * NQKV + 2 * NQ + H + 3 * I));
    char *xn = ws, *qkv = xn + es * T * H, *qs = qkv + es * T * NQKV, *ks = qs + es * T * NQ, *vs = ks + es * T * NKV;
    char *qr = vs + es * T * NKV, *attn = qr + es * T * NQ, *o = attn + es * T * NQ, *h = o + es * T * H;
    char *act = h + es * T * 2 * I;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc((size_t)(H > 3 * G * D + D ? H : 3 * G * D + D) * sizeof(float));
        float *sc = (float *)malloc((size_t)(G * maxn) * sizeof(float));
#pragma omp single
        {
            if (res == 0) memcpy(res_out, x, es * T * H);
            if (dt)
                rms_rows(x, res, res_out, n1, xn, 0, T, H, eps1, 0.f, 1, 1, buf);
            else
                rms_rows(x, res, res_out, n1, xn, 0, T, H, eps1, 0.f, 0, 0, buf);
        }
        gemv_par(xn, T, H, qkv_w, NQKV, qkv, dt);
#pragma omp single
        {
            for (int64_t t = 0; t < T; t++) {
                memcpy(qs + es * t * NQ, qkv + es * t * NQKV, es * NQ);
                memcpy(ks + es * t * NKV, qkv + es * (t * NQKV + NQ), es * NKV);
                memcpy(vs + es * t * NKV, qkv + es * (t * NQKV + NQ + NKV), es * NKV);
            }
            if (dt)
                rope_rows(qs, ks, vs, pos, cs, kc, vc, slots, qr, 0, T, Hq, Hk, D, 1);
            else
                rope_rows(qs, ks, vs, pos, cs, kc, vc, slots, qr, 0, T, Hq, Hk, D, 0);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < T * Hk; u++) {
            const int64_t b = u / Hk, hk = u % Hk, n = seq_lens[b];
            if (n <= 0) {
                for (int64_t i = 0; i < G * D; i++) {
                    if (dt)
                        ((uint16_t *)attn)[(b * Hq + hk * G) * D + i] = 0;
                    else
                        ((float *)attn)[(b * Hq + hk * G) * D + i] = 0.f;
                }
                continue;
            }
            const int64_t start = window > 0 && n > window ? n - window : 0;
            float *qf = buf, *acc = qf + G * D, *kf = acc + G * D;
            if (dt)
                attend(qr, kc, vc, block_table + b * bt_stride, ps, Hk, D, G, b, hk, start, n, scale, attn, sc, qf, kf,
                       acc, 1);
            else
                attend(qr, kc, vc, block_table + b * bt_stride, ps, Hk, D, G, b, hk, start, n, scale, attn, sc, qf, kf,
                       acc, 0);
        }
        gemv_par(attn, T, NQ, o_w, H, o, dt);
#pragma omp single
        {
            if (dt)
                rms_rows(o, res_out, res_out, n2, xn, 0, T, H, eps2, 0.f, 1, 1, buf);
            else
                rms_rows(o, res_out, res_out, n2, xn, 0, T, H, eps2, 0.f, 0, 0, buf);
        }
        gemv_par(xn, T, H, gu_w, 2 * I, h, dt);
#pragma omp single
        {
            if (dt)
                silu_rows(h, act, 0, T, I, 1);
            else
                silu_rows(h, act, 0, T, I, 0);
        }
        gemv_par(act, T, I, down_w, H, out, dt);
        free(sc);
        free(buf);
    }
    free(ws);
    return 0;
}
