// bf16 GEMM D[M, N] = A[M, K] @ B[N, K]^T (fp32 accumulation) on Hopper through CUTLASS 3's warp-specialized TMA
// kernels: the activations A row-major, the weight B row-major [N, K] (K-major, as torch stores a Linear's weight),
// D row-major. One translation unit per configuration; the build (cutlass_gemm.py beside this file) compiles this file once per
// configuration with these macros set:
//
//   IC_NAME       the exported symbol prefix
//   IC_TM/TN/TK   the CTA tile (M x N x K)
//   IC_CM/CN      the cluster shape (CTAs along M / N; a 2 x 1 cluster multicasts each weight tile to both M tiles)
//   IC_PINGPONG   1: the ping-pong schedule (two consumer warp groups on alternate tiles), else cooperative
//   IC_STREAMK    1: the stream-K tile scheduler (decomposition chosen per call: heuristic / data-parallel / split-K /
//                 stream-K), else the persistent data-parallel scheduler
//
// Exported (C ABI, called through ctypes; ``stream`` is a cudaStream_t):
//   size_t IC_NAME_workspace(int M, int N, int K, int mode, int splits, int sms)
//   int    IC_NAME_run(A, B, D, M, N, K, lda, ldb, ldd, mode, splits, workspace, workspace_bytes, sms, stream)
// ``mode`` (stream-K builds only): 0 heuristic, 1 data-parallel, 2 split-K into ``splits``, 3 stream-K.
// Return codes: 0 done, 1 the shape or alignment is not supported, 2 workspace too small, 3 initialize failed,
// 4 the launch failed.

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

#ifndef IC_NAME
#define IC_NAME ic_gemm
#endif
#ifndef IC_TM
#define IC_TM 128
#endif
#ifndef IC_TN
#define IC_TN 256
#endif
#ifndef IC_TK
#define IC_TK 64
#endif
#ifndef IC_CM
#define IC_CM 1
#endif
#ifndef IC_CN
#define IC_CN 1
#endif
#ifndef IC_PINGPONG
#define IC_PINGPONG 0
#endif
#ifndef IC_STREAMK
#define IC_STREAMK 0
#endif

#define IC_CAT2(a, b) a##b
#define IC_CAT(a, b) IC_CAT2(a, b)

using namespace cute;

namespace {

using Element = cutlass::bfloat16_t;
using Acc = float;
constexpr int kAlign = 8;  // 16-byte accesses

using TileShape = Shape<Int<IC_TM>, Int<IC_TN>, Int<IC_TK>>;
using ClusterShape = Shape<Int<IC_CM>, Int<IC_CN>, _1>;

#if IC_PINGPONG
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

#if IC_STREAMK
using Scheduler = cutlass::gemm::StreamKScheduler;
#else
using Scheduler = cutlass::gemm::PersistentScheduler;
#endif

// No source operand (C = void): D = acc, converted to bf16.
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc,
    void, cutlass::layout::RowMajor, kAlign,
    Element, cutlass::layout::RowMajor, kAlign, EpiSchedule>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, cutlass::layout::RowMajor, kAlign,
    Element, cutlass::layout::ColumnMajor, kAlign, Acc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    MainSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

typename Gemm::Arguments make_args(const void* a, const void* b, void* d, int m, int n, int k, int lda, int ldb,
                                   int ldd, int mode, int splits, int sms) {
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;
  // A [M, K] row-major: (m, k, l) -> m * lda + k; B [N, K] row-major seen as K x N column-major: (n, k, l) -> n * ldb + k;
  // D [M, N] row-major: (m, n, l) -> m * ldd + n.
  StrideA sa = make_stride(int64_t(lda), Int<1>{}, int64_t(0));
  StrideB sb = make_stride(int64_t(ldb), Int<1>{}, int64_t(0));
  StrideD sd = make_stride(int64_t(ldd), Int<1>{}, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sms;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(a), sa, static_cast<const Element*>(b), sb},
      {{}, nullptr, sd, static_cast<Element*>(d), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
#if IC_STREAMK
  using Decomp = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;
  args.scheduler.splits = splits > 0 ? splits : 1;
  args.scheduler.decomposition_mode = mode == 1   ? Decomp::DataParallel
                                      : mode == 2 ? Decomp::SplitK
                                      : mode == 3 ? Decomp::StreamK
                                                  : Decomp::Heuristic;
#else
  (void)mode;
  (void)splits;
#endif
  return args;
}

}  // namespace

extern "C" size_t IC_CAT(IC_NAME, _workspace)(int m, int n, int k, int mode, int splits, int sms) {
  auto args = make_args(nullptr, nullptr, nullptr, m, n, k, k, k, n, mode, splits, sms);
  return Gemm::get_workspace_size(args);
}

extern "C" int IC_CAT(IC_NAME, _run)(const void* a, const void* b, void* d, int m, int n, int k, int lda, int ldb,
                                     int ldd, int mode, int splits, void* workspace, size_t workspace_bytes, int sms,
                                     void* stream) {
  auto args = make_args(a, b, d, m, n, k, lda, ldb, ldd, mode, splits, sms);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return 2;
  auto s = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, workspace, s) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(s) != cutlass::Status::kSuccess) return 4;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}
