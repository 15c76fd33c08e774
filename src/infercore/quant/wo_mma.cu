// MODE 9: weight-only GEMM for 1-16 activation rows on tensor cores, one stream-K wave (CUDA C++, NVRTC).
//
// y[M, N] = x[M, K] @ W^T with W stored as INT4 codes (group-wise scale and zero point) or FP8 e4m3 bytes
// (per-channel or 128x128 block scales), decoded in registers straight into mma.m16n8k16 A fragments: the
// weights are the 16-row operand (16 channels per MMA) and the activation rows the 8-column one, so M <= 8 takes
// one MMA per 16 channels x 16 K and M <= 16 (ROWS16) two.
//
// Work unit: BN channels x BK = 128 K of the weight (BN = NWARPS_N warps x MT m16 tiles; 16 KB by default) stored
// contiguously by ``cuda_mma.repack_*`` in the order the warps read it: [warp][j][lane][16 bytes] (word s WPS + p of a
// lane is component % 4 of its uint4 j = (s WPS + p) / 4: K step s, word p), then the unit's scale words
// [warp][g][tile] (one 16-byte (INT4, MT 2) / 8-byte (FP8, INT4 MT 1) load per lane). Unit u = nb * KT + kt. With KSPLIT = 2 a CTA has 16 warps: warps
// w and w + 8 take the same channels and the two halves of each unit's K, and add their sums in shared memory at
// the end of each channel block's segment (measured slower than KSPLIT = 1 on the H200; not dispatched).
// The grid is one wave of CTAs; CTA c streams units [c U / G, (c + 1) U / G) through a STAGES-deep cp.async ring
// (weights, per-channel scale words and the activations' 16 x 128 tile, swizzled for ldmatrix). Launched with
// programmatic dependent launch (sm90+), a CTA fetches the weights of its first STAGES - 1 units before
// griddepcontrol.wait and everything the previous kernel may write (activations, partial slots, y) after it.
// A channel block covered by several CTAs is
// finished by the CTA holding its first unit, which reaches that unit last in its range; the others store fp32
// partials over a sentinel pattern (0xFFFFFFFF, a NaN no fp32 arithmetic produces) and the finisher copies all its
// contributors' slots at once into the ring's free stages (cp.async), re-copies the pending ones until none is
// left, adds them in a fixed order, writes the sentinel back for the next launch (or graph replay) and stores y. No
// flag, fence or atomic on the way.
//
// INT4 word (lane l, g = l / 4, c = l % 4; m16 tile p of the warp): nibble i holds channel g + 8 ((i >> 1) & 1),
// k = 2c + (i >> 2) + 8 (i & 1); lop3 with a magic exponent gives two 16-bit floats (magic + q) per nibble pair,
// exact; one HFMA2 (HADD2) per register subtracts magic + z, exact too (the result is q - z). Per unit (one
// quantization group: group % 128 == 0) the fp32 tile result is multiplied by the scale and added up.
// FP8 words (channel g, then g + 8): byte b holds k = 2c + (b & 1) + 8 (b >> 1); sign | exponent-mantissa moved
// into a bf16 (fp16) is the value times 2^-120 (2^-8), exact; the fold is multiplied back with the scale.
//
// NF4 words (the INT4 layout, nibbles reordered by ``cuda_mma.repack_nf4``): nibbles 2i, 2i + 1 are one A register
// (a0, a2, a1, a3 for i = 0..3), looked up in the 16-entry codebook rounded to the activation dtype by byte permutes
// (nf4_quad); the unit's two 64-K halves accumulate apart and are multiplied by their fp32 absmax.
//
// FP4 words: the NF4 layout and lookup (the e2m1 table); each K step's A registers are multiplied by their block
// scales (fp4_scale2) before the MMA, NVFP4's tensor scale multiplies y.
//
// Compile-time switches (-D): FP8 (0/1), NF4 (0/1), FP4 (0/1/2), ACT_BF16 (1: bf16 activations, 0: fp16), ROWS16 (0: M <= 8, 1: M <= 16),
// STAGES, MIN_BLOCKS, KSPLIT (1 / 2), PROBE (timing probes only: 1 no decode / MMA, 2 no weight loads; results
// wrong), TIMING (1: thread 0 of each CTA writes clock64 / globaltimer stamps after the partial-sum slots).

#ifndef FP8
#define FP8 0
#endif
#ifndef NF4  // 1: 4-bit codes into a 16-entry codebook (bitsandbytes NF4 / FP4), fp32 absmax per 64 K (or per unit)
#define NF4 0
#endif
#ifndef FP4  // e2m1 codes (the codebook path) with block scale bytes: 1 MXFP4 (e8m0 per 32 K), 2 NVFP4 (e4m3 per 16 K)
#define FP4 0
#endif
#define LUT4 (NF4 || FP4)

#ifndef ACT_BF16
#define ACT_BF16 1
#endif
#ifndef ROWS16
#define ROWS16 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef PROBE
#define PROBE 0
#endif
#ifndef TIMING
#define TIMING 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef KSPLIT  // warps per channel slice, each taking 128 / KSPLIT of every unit's K
#define KSPLIT 1
#endif

#ifndef SPLITACC  // 1: odd K steps accumulate in a second register set (two HMMA chains per tile), added per unit;
                  // measured 1-3% faster except INT4 at 9-16 rows (120 registers there, no gain)
#define SPLITACC (FP8 || !ROWS16)
#endif

#ifndef NWARPS_N  // warps per K part, each taking its own MT m16 tiles of channels (cuda_mma's layout "warps")
#define NWARPS_N 8
#endif
#ifndef MT4  // INT4: m16 tiles per warp (cuda_mma's layout "mt"; FP8 always takes one)
#define MT4 2
#endif
#if FP4 == 1 && !ACT_BF16
#error "MXFP4 needs bf16 activations (e8m0 scales in the 16-bit type)"
#endif
#if LUT4 && (FP8 || KSPLIT != 1 || (NF4 && FP4))
#error "NF4 / FP4 take the INT4 unit layout with KSPLIT 1"
#endif
#define CT (NWARPS_N * 32)  // threads of one K part: partial-sum slots and outputs are indexed by them
#define THREADS (CT * KSPLIT)
#define SPW (8 / KSPLIT)  // K steps of 16 per warp per unit
#define BK 128
#if FP8
#define MT 1   // m16 tiles per warp (two words each per K step)
#define WPS 2  // words per lane per K step
#else
#define MT MT4  // m16 tiles per warp (one word each per K step)
#define WPS MT4
#endif
#define WN (16 * MT)
#define SPG (2 * MT)  // scale words per lane group g: two channels (g, g + 8) per m16 tile
#define NSW (SPG * ((NF4 || FP4 == 2) ? 2 : 1))  // NF4: the two 64-K halves ([h][t]); NVFP4: 8 scale bytes ([t][2])
#define NACC (NF4 ? 2 : 1 + SPLITACC)  // accumulator sets: NF4 one per absmax half, else per K step parity
#define NTN (ROWS16 ? 2 : 1)  // n8 tiles of activation rows
#define PB (MT * NTN >= 4 ? 1 : 4 / (MT * NTN))  // K-split finish: contributors polled at once (16 registers)
#define BN (NWARPS_N * WN)
#define W_BYTES (BN * BK / (FP8 ? 1 : 2))
#define SZ_BYTES (BN * 4 * ((NF4 || FP4 == 2) ? 2 : 1))
#define X_BYTES 4096
#define X_CHUNKS ((ROWS16 ? 16 : 8) * 16)  // 16-byte chunks of one unit's activation tile
#define X_PER_THREAD ((X_CHUNKS + THREADS - 1) / THREADS)
// The activation tile starts 256-byte aligned in its stage: the ldmatrix addresses XOR the K step into bits 5-7 of
// the offset (the swizzle), which must be the tile's own bits (a 112-channel unit's weights and scales end at 7616).
#define X_OFF ((W_BYTES + SZ_BYTES + 255) / 256 * 256)
#define STAGE_BYTES (X_OFF + X_BYTES)
#define SENTINEL 0xFFFFFFFFu

typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2)); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Programmatic dependent launch (sm90+; no-ops without it or when launched without the attribute): let the next
// kernel in the stream launch now, and wait here until the previous one has finished and its writes are visible.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32* a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

__device__ __forceinline__ long long gtimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// d += A (16 x 16, four registers) B (16 x 8, two registers), fp32 accumulators.
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if ACT_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// (a & b) | c
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// a * 1 + c on 16-bit float pairs (exact here: magic + q minus magic + z)
__device__ __forceinline__ u32 add2(u32 a, u32 c) {
  u32 d;
#if ACT_BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(c));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(0x3C003C00u), "r"(c));
#endif
  return d;
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 d;
#if ACT_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

#if ACT_BF16
#define MAGIC2 0x43004300u    // 128.0 in bf16, twice: magic + q is exact for q < 128
#define MAGIC_F32 0x43000000u  // 128.0f; + (z << 16) is 128 + z
#define MAGIC_SHIFT 16
#define ONES2 0x3F803F80u
#define NEG_MAGIC 0xC300u
#define FP8_FOLD 1.329227995784916e36f  // 2^120
#else
#define MAGIC2 0x64006400u    // 1024.0 in fp16
#define MAGIC_F32 0x44800000u  // 1024.0f; + (z << 13) is 1024 + z
#define MAGIC_SHIFT 13
#define ONES2 0x3C003C00u
#define NEG_MAGIC 0xE400u
#define FP8_FOLD 256.0f
#endif

// e4m3 bytes 0, 1 (sel 0x9180) or 2, 3 (0xB3A2) of w -> two 16-bit floats (value x 2^-120 in bf16, 2^-8 in fp16).
// prmt puts each byte in the low half of a 16-bit lane and its sign, replicated (selector bit 3), in the high
// half; one shift then lands the sign on bit 15 and exponent-mantissa on the 16-bit float's low exponent bits, and
// one mask clears the rest: exact, two ALU operations and a shift the compiler may give the FMA pipe (IMAD.SHL).
#ifndef FP8DEC  // 0: the older decode (byte_perm, shift, two masks), kept for timing probes
#define FP8DEC 1
#endif
__device__ __forceinline__ u32 fp8x2(u32 w, u32 sel) {
#if !FP8DEC
  const u32 t = __byte_perm(w, 0, sel == 0x9180u ? 0x1404 : 0x3424);
#if ACT_BF16
  return and_or(t, 0x80008000u, (t >> 4) & 0x07F007F0u);
#else
  return and_or(t, 0x80008000u, (t >> 1) & 0x3F803F80u);
#endif
#endif
  u32 p;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(p) : "r"(w), "r"(sel));
#if ACT_BF16
  return (p << 4) & 0x87F087F0u;
#else
  return (p << 7) & 0xBF80BF80u;
#endif
}

// NF4: four codes (the selector nibbles of s's low 16 bits) -> the low / high bytes of their 16-bit codebook values,
// paired: a = codes 0, 1, b = codes 2, 3 (two 16-bit floats each, the first in the low half). t[0..3] hold the low
// bytes of entries 0-3, 4-7, 8-11, 12-15, t[4..7] the high bytes. prmt's byte select takes 3 bits, so each byte is
// looked up in both 8-entry halves and a mask made from the codes' top bits (prmt's sign-replicate mode) picks one.
__device__ __forceinline__ void nf4_quad(u32 s, const u32 (&t)[8], u32& a, u32& b) {
  const u32 q = s & 0x7777u, tt = s & 0x8888u;
  const u32 u = (tt >> 1) | tt | 0x3210u;
  u32 m;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(m) : "r"(0u), "r"(0x80808080u), "r"(u));
  const u32 la = __byte_perm(t[0], t[1], q), lb = __byte_perm(t[2], t[3], q);
  const u32 ha = __byte_perm(t[4], t[5], q), hb = __byte_perm(t[6], t[7], q);
  const u32 lo = la ^ ((la ^ lb) & m), hi = ha ^ ((ha ^ hb) & m);
  a = __byte_perm(lo, hi, 0x5140);
  b = __byte_perm(lo, hi, 0x7362);
}

// FP4: the block scale of K step s (16 K) for channel slot t, as two equal 16-bit floats. MXFP4: byte s / 2 of word t,
// e8m0 -> 2^(e - 127) (bf16 only: e << 7, e = 0 the subnormal 2^-127); NVFP4: byte s % 4 of word 2t + s / 4, e4m3
// -> fp32 (the value times 2^-120 from two shifts, times 2^120) -> 16 bits, exact. e2m1 codes times these scales
// are exact in the 16-bit type, so the pairs are multiplied before the MMA.
__device__ __forceinline__ u32 fp4_scale2(const u32* sv, int t, int s) {
#if FP4 == 1
  const u32 e = (sv[t] >> (8 * (s >> 1))) & 0xFFu;
  const u32 h = e ? (e << 7) : 0x40u;
#else
  const u32 b = (sv[2 * t + (s >> 2)] >> (8 * (s & 3))) & 0xFFu;
  const float f = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * 1.329227995784916e36f;  // 2^120
  const u32 h = pack2(f, 0.f) & 0xFFFFu;
#endif
  return h * 0x10001u;
}

__device__ __forceinline__ u32 mul2(u32 a, u32 b) {
  u32 d;
#if ACT_BF16
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

// The partial exchange uses relaxed (morally strong) accesses: with weak ld / st, ptxas may assume no other thread
// writes the slot, fold the polling loop into one load and move the sentinel store ahead of it (seen in SASS).
__device__ __forceinline__ void st_cg4(float* p, float a, float b, float c, float d) {
  asm volatile("st.relaxed.gpu.global.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
__device__ __forceinline__ void ld_cg4(const float* p, float* v) {
  asm volatile("ld.relaxed.gpu.global.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "l"(p)
               : "memory");
}
__device__ __forceinline__ bool pending(const float* v) {
  return __float_as_uint(v[0]) == SENTINEL || __float_as_uint(v[1]) == SENTINEL ||
         __float_as_uint(v[2]) == SENTINEL || __float_as_uint(v[3]) == SENTINEL;
}

// Word i of a lane's unit (uint4 i / 4, component i % 4; i is a compile-time constant after unrolling).
template <int NQ>
__device__ __forceinline__ u32 word(const uint4 (&wv)[NQ], int i) {
  const uint4& q = wv[i >> 2];
  return (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
}

__device__ __forceinline__ int unit_start(int c, int U, int G) { return (int)(((long long)c * U) / G); }

// Partial-sum slot of CTA c, accumulator tile q, thread ct of K part 0 (float4 granules, coalesced).
__device__ __forceinline__ float* slot(float* ws, int c, int q, int ct) {
  return ws + (((size_t)c * (MT * NTN) + q) * CT + ct) * 4;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
    wo_mma(const uint4* __restrict__ wpk, const uint4* __restrict__ szk, const unsigned short* __restrict__ x,
           unsigned short* __restrict__ y, float* __restrict__ ws, int M, int N, int KT, int NB, int ldx
#if LUT4
           , const u32* __restrict__ tab  // the codebook's byte tables, then NVFP4's fp32 tensor scale
#endif
    ) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % NWARPS_N, kh = warp / NWARPS_N, ct = tid % CT;  // channel slice, K part
  const int G = gridDim.x, U = NB * KT, cta = blockIdx.x;
  const int u0 = unit_start(cta, U, G), n_units = unit_start(cta + 1, U, G) - u0;
  const int g = lane >> 2, c4 = lane & 3;
  const u32 smem0 = smem_u32(smem);
#if TIMING
  long long stamp[6] = {clock64(), gtimer(), 0, 0, 0, 0};
  long long poll_rounds = 0, first_round = 0;  // the finish: polling rounds, cycles when the first copies landed
#endif

  pdl_trigger();

  // ---- loads: the next unit into the stage at byte offset wr; the sources advance one unit per load ----
  // activation chunks this thread copies: chunk tid + i THREADS is row >> 4, 16-byte column & 15
  const bool s_loader = tid < SZ_BYTES / 16;
  const unsigned short* xsrc[X_PER_THREAD];
  u32 xdst[X_PER_THREAD];
#pragma unroll
  for (int i = 0; i < X_PER_THREAD; i++) {
    const int ch = tid + i * THREADS, xr = (ch >> 4) & 15, xch = ch & 15;
    xsrc[i] = x + (size_t)(xr < M ? xr : M - 1) * ldx + xch * 8;
    xdst[i] = X_OFF + xr * 256 + ((xch ^ (xr & 7)) << 4);
  }
  const uint4* wsrc = wpk + (size_t)u0 * (W_BYTES / 16) + tid;
  const uint4* ssrc = szk + (size_t)u0 * (SZ_BYTES / 16) + (s_loader ? tid : 0);
  const int kw = KT * BK;
  int xk = (u0 % KT) * BK;
  u32 wr = 0;
  auto load_weights = [&]() {  // the unit's weight words and scale words (constant: safe before pdl_wait)
    const u32 base = smem0 + wr;
#pragma unroll
    for (int i = 0; i < W_BYTES / 16 / THREADS; i++)
      if (PROBE != 2) cp16(base + (tid + i * THREADS) * 16, wsrc + i * THREADS);
    if (s_loader) cp16(base + W_BYTES + tid * 16, ssrc);
    wsrc += W_BYTES / 16, ssrc += SZ_BYTES / 16;
  };
  auto load_x = [&]() {  // the unit's activation tile (written by the previous kernel: after pdl_wait)
#pragma unroll
    for (int i = 0; i < X_PER_THREAD; i++)
      if (tid + i * THREADS < X_CHUNKS) cp16(smem0 + wr + xdst[i], xsrc[i] + xk);
    xk += BK;
    if (xk == kw) xk = 0;
    wr += STAGE_BYTES;
    if (wr == STAGES * STAGE_BYTES) wr = 0;
  };
  // The ring's first STAGES - 1 units: weights first (one group each), then, once the previous kernel is done,
  // their activation tiles (one more group); the first iteration waits for all of them.
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < n_units) load_weights(), wr += STAGE_BYTES;
    cp_commit();
  }
  pdl_wait();
  wr = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++)
    if (s < n_units) load_x();
  cp_commit();

  float acc[MT][NTN][4];
#pragma unroll
  for (int a = 0; a < MT; a++)
#pragma unroll
    for (int b = 0; b < NTN; b++) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.f;
  int nb = u0 / KT, kt = u0 - nb * KT;
  bool head = kt != 0;  // the first segment continues a block that another CTA finishes
  // ldmatrix row / chunk of this lane: ROWS16 one K step (rows 0-15) per x4, else two K steps of rows 0-7. The
  // chunk of K step s is ((first + 2 s) ^ (row & 7)) = (first ^ (row & 7)) ^ 2 s: first < 2 (< 4) has no bit of 2 s.
  const int lrow = ROWS16 ? (lane & 7) + ((lane >> 4) << 3) : (lane & 7);
  const int lchunk = ROWS16 ? ((lane >> 3) & 1) : (lane >> 3);
  const u32 xoff = X_OFF + lrow * 256 + kh * SPW * 32 + ((lchunk ^ (lrow & 7)) << 4);
  const u32 woff = (wn * 64 * WPS + kh * (SPW * WPS / 4) * 32 + lane) * 16;
  const u32 soff = W_BYTES + (wn * 8 * NSW + g * NSW) * 4;
  u32 rd = 0;
#if LUT4
  u32 tb[8];  // the codebook's byte tables (nf4_quad)
#pragma unroll
  for (int i = 0; i < 8; i++) tb[i] = __ldg(tab + i);
#endif
#if FP4 == 2
  const float y_scale = __uint_as_float(__ldg(tab + 8));  // NVFP4's tensor scale
#else
  const float y_scale = 1.f;
#endif

  for (int i = 0; i < n_units; i++) {
    if (i == 0)
      cp_wait_all();
    else
      cp_wait();
    __syncthreads();
#if TIMING
    if (i == 0) stamp[2] = clock64();
#endif
    if (i + STAGES - 1 < n_units) load_weights(), load_x();
    cp_commit();

    // ---- one unit: this warp's MT m16 tiles x its 128 / KSPLIT of K ----
    const unsigned char* st = smem + rd;
    const u32 stu = smem0 + rd;
    uint4 wv[SPW * WPS / 4];
#pragma unroll
    for (int j = 0; j < SPW * WPS / 4; j++) wv[j] = *reinterpret_cast<const uint4*>(st + woff + j * 512);
    u32 sv[NSW];  // scale words: channel g, then g + 8, of each m16 tile (NF4: for each 64-K half)
    {
#if NSW == 8
      const uint4 v0 = *reinterpret_cast<const uint4*>(st + soff);
      const uint4 v1 = *reinterpret_cast<const uint4*>(st + soff + 16);
      sv[0] = v0.x, sv[1] = v0.y, sv[2] = v0.z, sv[3] = v0.w, sv[4] = v1.x, sv[5] = v1.y, sv[6] = v1.z, sv[7] = v1.w;
#elif NSW == 4
      const uint4 v = *reinterpret_cast<const uint4*>(st + soff);
      sv[0] = v.x, sv[1] = v.y, sv[2] = v.z, sv[3] = v.w;
#else
      const uint2 v = *reinterpret_cast<const uint2*>(st + soff);
      sv[0] = v.x, sv[1] = v.y;
#endif
    }
#if !FP8 && !LUT4
    // -(magic + z) twice per register, z < 16 in the scale words' low bits (no carry)
    u32 negz[SPG];
#pragma unroll
    for (int e = 0; e < SPG; e++) negz[e] = (sv[e] & 15u) * 0x10001u + NEG_MAGIC * 0x10001u;
#endif
    float tmp[NACC][MT][NTN][4];  // [K step parity (SPLITACC) / NF4's 64-K half][m16 tile][n8 tile][register]
#pragma unroll
    for (int h = 0; h < NACC; h++)
#pragma unroll
      for (int a = 0; a < MT; a++)
#pragma unroll
        for (int b = 0; b < NTN; b++) tmp[h][a][b][0] = tmp[h][a][b][1] = tmp[h][a][b][2] = tmp[h][a][b][3] = 0.f;
#if !ROWS16
    u32 xr4[4];
#endif
#pragma unroll
    for (int s = 0; s < SPW; s++) {
      if (PROBE == 1) break;
      u32 xb[NTN][2];
#if ROWS16
      {
        u32 r[4];
        ldsm_x4(stu + (xoff ^ (s << 5)), r);
        xb[0][0] = r[0], xb[0][1] = r[1], xb[1][0] = r[2], xb[1][1] = r[3];
      }
#else
      if ((s & 1) == 0) ldsm_x4(stu + (xoff ^ (s << 5)), xr4);  // two K steps
      xb[0][0] = xr4[(s & 1) * 2], xb[0][1] = xr4[(s & 1) * 2 + 1];
#endif
#if LUT4
#pragma unroll
      for (int p = 0; p < MT; p++) {
        // the repack orders a word's nibbles so that each pair is one A register: (a0, a2) from the low half
        const u32 w = word(wv, s * WPS + p);
        u32 a0, a1, a2, a3;
        nf4_quad(w, tb, a0, a2);
        nf4_quad(w >> 16, tb, a1, a3);
#if FP4
        const u32 sg = fp4_scale2(sv, 2 * p, s), sh = fp4_scale2(sv, 2 * p + 1, s);  // channels g, g + 8
        a0 = mul2(a0, sg), a2 = mul2(a2, sg), a1 = mul2(a1, sh), a3 = mul2(a3, sh);
#pragma unroll
        for (int b = 0; b < NTN; b++) mma(tmp[SPLITACC & s][p][b], a0, a1, a2, a3, xb[b][0], xb[b][1]);
#else
#pragma unroll
        for (int b = 0; b < NTN; b++) mma(tmp[s / (SPW / 2)][p][b], a0, a1, a2, a3, xb[b][0], xb[b][1]);
#endif
      }
#elif FP8
      const u32 w0 = word(wv, s * WPS), w1 = word(wv, s * WPS + 1);
      const u32 a0 = fp8x2(w0, 0x9180u), a2 = fp8x2(w0, 0xB3A2u);
      const u32 a1 = fp8x2(w1, 0x9180u), a3 = fp8x2(w1, 0xB3A2u);
#pragma unroll
      for (int b = 0; b < NTN; b++) mma(tmp[SPLITACC & s][0][b], a0, a1, a2, a3, xb[b][0], xb[b][1]);
#else
#pragma unroll
      for (int p = 0; p < MT; p++) {
        const u32 w = word(wv, s * WPS + p);
        u32 v0 = and_or(w, 0x000F000Fu, MAGIC2), v1 = and_or(w >> 4, 0x000F000Fu, MAGIC2);
        u32 v2 = and_or(w >> 8, 0x000F000Fu, MAGIC2), v3 = and_or(w >> 12, 0x000F000Fu, MAGIC2);
        v0 = add2(v0, negz[2 * p]), v1 = add2(v1, negz[2 * p]);
        v2 = add2(v2, negz[2 * p + 1]), v3 = add2(v3, negz[2 * p + 1]);
#pragma unroll
        for (int b = 0; b < NTN; b++)
          mma(tmp[SPLITACC & s][p][b], v0, v2, v1, v3, xb[b][0], xb[b][1]);
      }
#endif
    }
#if SPLITACC && !NF4
#pragma unroll
    for (int a = 0; a < MT; a++)
#pragma unroll
      for (int b = 0; b < NTN; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) tmp[0][a][b][e] += tmp[1][a][b][e];
#endif
#pragma unroll
    for (int a = 0; a < MT; a++) {
#if FP4
#pragma unroll
      for (int b = 0; b < NTN; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[a][b][e] += tmp[0][a][b][e];
#elif NF4
      const float sA = __uint_as_float(sv[2 * a]), sB = __uint_as_float(sv[2 * a + 1]);
      const float tA = __uint_as_float(sv[SPG + 2 * a]), tB = __uint_as_float(sv[SPG + 2 * a + 1]);
#pragma unroll
      for (int b = 0; b < NTN; b++) {
        acc[a][b][0] = fmaf(tmp[1][a][b][0], tA, fmaf(tmp[0][a][b][0], sA, acc[a][b][0]));
        acc[a][b][1] = fmaf(tmp[1][a][b][1], tA, fmaf(tmp[0][a][b][1], sA, acc[a][b][1]));
        acc[a][b][2] = fmaf(tmp[1][a][b][2], tB, fmaf(tmp[0][a][b][2], sB, acc[a][b][2]));
        acc[a][b][3] = fmaf(tmp[1][a][b][3], tB, fmaf(tmp[0][a][b][3], sB, acc[a][b][3]));
      }
#else
#if FP8
      const float sA = __uint_as_float(sv[0]) * FP8_FOLD, sB = __uint_as_float(sv[1]) * FP8_FOLD;
#else
      const float sA = __uint_as_float(sv[2 * a] & ~15u), sB = __uint_as_float(sv[2 * a + 1] & ~15u);
#endif
#pragma unroll
      for (int b = 0; b < NTN; b++) {
        acc[a][b][0] = fmaf(tmp[0][a][b][0], sA, acc[a][b][0]);
        acc[a][b][1] = fmaf(tmp[0][a][b][1], sA, acc[a][b][1]);
        acc[a][b][2] = fmaf(tmp[0][a][b][2], sB, acc[a][b][2]);
        acc[a][b][3] = fmaf(tmp[0][a][b][3], sB, acc[a][b][3]);
      }
#endif
    }
    rd += STAGE_BYTES;
    if (rd == STAGES * STAGE_BYTES) rd = 0;

    // ---- end of a channel block's segment ----
    const int this_nb = nb, this_kt = kt;
    if (++kt == KT) kt = 0, nb++;
    if (this_kt != KT - 1 && i != n_units - 1) continue;
#if KSPLIT > 1
    {  // K part 1 hands its sums to part 0 (the area is read before the next segment's writes: a barrier between)
      float4* red = reinterpret_cast<float4*>(smem + STAGES * STAGE_BYTES) + ct;
      if (kh) {
#pragma unroll
        for (int q = 0; q < MT * NTN; q++) {
          float* d = acc[q / NTN][q % NTN];
          red[q * CT] = make_float4(d[0], d[1], d[2], d[3]);
          d[0] = d[1] = d[2] = d[3] = 0.f;
        }
      }
      __syncthreads();
      if (kh) {
        head = false;
        continue;
      }
#pragma unroll
      for (int q = 0; q < MT * NTN; q++) {
        const float4 v = red[q * CT];
        float* d = acc[q / NTN][q % NTN];
        d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
      }
    }
#endif
#if TIMING
    if (i == n_units - 1) stamp[3] = clock64();
#endif
    if (head) {  // a later part of the block: leave the partial sums to the CTA holding its first unit
      head = false;
#pragma unroll
      for (int q = 0; q < MT * NTN; q++) {
        float* d = acc[q / NTN][q % NTN];
        st_cg4(slot(ws, cta, q, ct), d[0], d[1], d[2], d[3]);
        d[0] = d[1] = d[2] = d[3] = 0.f;
      }
      continue;
    }
    if (this_kt != KT - 1) {  // this CTA holds the block's first unit: add the other CTAs' partials
      const int last = (this_nb + 1) * KT;
      // All contributors' slots are read at once (batches of STAGES - 1 CTAs into shared memory; of PB into
      // registers with K parts), and only the pending ones again: one L2 round trip after the last partial lands
      // instead of one per slot and contributor.
      int c_end = cta + 1;
      while (c_end < G && unit_start(c_end, U, G) < last) c_end++;
#if KSPLIT == 1  // landed in shared memory (no registers; measured faster than the register batches)
      // This is the CTA's last unit: every warp is past the stages of the units before it, so the STAGES - 1 stages
      // from rd on are free. Contributor p of a batch lands in one of them (16 KB at most); each thread copies and
      // reads only its own granules, re-copying the pending ones until none is left.
      for (int cb = cta + 1; cb < c_end; cb += STAGES - 1) {
        const int np = c_end - cb < STAGES - 1 ? c_end - cb : STAGES - 1;
        unsigned pend = 0;
        for (int p = 0; p < np; p++) {
          u32 stg = rd + p * STAGE_BYTES;
          if (stg >= STAGES * STAGE_BYTES) stg -= STAGES * STAGE_BYTES;
#pragma unroll
          for (int q = 0; q < MT * NTN; q++) {
            cp16(smem0 + stg + (q * CT + ct) * 16, slot(ws, cb + p, q, ct));
            pend |= 1u << (p * MT * NTN + q);
          }
        }
        while (pend) {
          cp_commit();
          cp_wait_all();
#if TIMING
          if (poll_rounds++ == 0) first_round = clock64() - stamp[0];
#endif
          for (int p = 0; p < np; p++) {
            u32 stg = rd + p * STAGE_BYTES;
            if (stg >= STAGES * STAGE_BYTES) stg -= STAGES * STAGE_BYTES;
#pragma unroll
            for (int q = 0; q < MT * NTN; q++) {
              const unsigned bit = 1u << (p * MT * NTN + q);
              if (!(pend & bit)) continue;
              const float4 v = *reinterpret_cast<const float4*>(smem + stg + (q * CT + ct) * 16);
              const float vv[4] = {v.x, v.y, v.z, v.w};
              if (pending(vv))
                cp16(smem0 + stg + (q * CT + ct) * 16, slot(ws, cb + p, q, ct));
              else
                pend &= ~bit;
            }
          }
        }
        // all landed: add them in a fixed order (the same as the register batches), so repeated calls agree bit
        // for bit
        const float sent = __uint_as_float(SENTINEL);
        for (int p = 0; p < np; p++) {
          u32 stg = rd + p * STAGE_BYTES;
          if (stg >= STAGES * STAGE_BYTES) stg -= STAGES * STAGE_BYTES;
#pragma unroll
          for (int q = 0; q < MT * NTN; q++) {
            const float4 v = *reinterpret_cast<const float4*>(smem + stg + (q * CT + ct) * 16);
            float* d = acc[q / NTN][q % NTN];
            d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
            st_cg4(slot(ws, cb + p, q, ct), sent, sent, sent, sent);
          }
        }
      }
#else
      for (int cb = cta + 1; cb < c_end; cb += PB) {
        float v[PB][MT * NTN][4];
#pragma unroll
        for (int p = 0; p < PB; p++)
          if (cb + p < c_end)
#pragma unroll
            for (int q = 0; q < MT * NTN; q++) ld_cg4(slot(ws, cb + p, q, ct), v[p][q]);
        bool wait;
        do {
          wait = false;
#pragma unroll
          for (int p = 0; p < PB; p++)
            if (cb + p < c_end)
#pragma unroll
              for (int q = 0; q < MT * NTN; q++)
                if (pending(v[p][q])) ld_cg4(slot(ws, cb + p, q, ct), v[p][q]), wait = true;
        } while (wait);
        const float sent = __uint_as_float(SENTINEL);
#pragma unroll
        for (int p = 0; p < PB; p++)
          if (cb + p < c_end)
#pragma unroll
            for (int q = 0; q < MT * NTN; q++) {
              float* d = acc[q / NTN][q % NTN];
              d[0] += v[p][q][0], d[1] += v[p][q][1], d[2] += v[p][q][2], d[3] += v[p][q][3];
              st_cg4(slot(ws, cb + p, q, ct), sent, sent, sent, sent);
            }
      }
#endif
    }
#if TIMING
    if (i == n_units - 1) stamp[4] = clock64();
#endif
    // acc[a][b][e]: channel a * 16 + g + 8 (e >> 1), activation row b * 8 + 2 c + (e & 1)
    const int nbase = this_nb * BN + wn * WN + g;
#pragma unroll
    for (int a = 0; a < MT; a++)
#pragma unroll
      for (int b = 0; b < NTN; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int n = nbase + a * 16 + 8 * (e >> 1), r = b * 8 + 2 * c4 + (e & 1);
          if (n < N && r < M) y[(size_t)r * N + n] = (unsigned short)(pack2(acc[a][b][e] * y_scale, 0.f) & 0xFFFFu);
          acc[a][b][e] = 0.f;
        }
  }
#if TIMING
  if (tid == 0) {
    stamp[5] = gtimer();
    long long* out = reinterpret_cast<long long*>(ws + (size_t)G * (MT * NTN) * CT * 4) + (size_t)cta * 8;
    out[0] = stamp[1], out[1] = stamp[2] - stamp[0], out[2] = stamp[3] - stamp[0], out[3] = stamp[4] - stamp[0];
    out[4] = stamp[5], out[5] = clock64() - stamp[0], out[6] = poll_rounds, out[7] = first_round;
  }
#endif
}
