// y[M, N] = x[M, K] @ w[N, K]^T (+ beta * c[M, N]) as a CUTLASS sm90 warp-specialized GEMM (bf16 in
// and out, fp32 accumulation), launched under programmatic dependent launch. Built with
// CUTLASS_ENABLE_GDC_FOR_SM90, its kernels execute griddepcontrol.wait before their first global
// load, so they may start on a programmatic edge: cuBLAS's kernels on this image do not wait
// (BENCHMARKS.md, twenty-second session). benchmarks/cutlass_gemm.py loads the library with ctypes.
#pragma once
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

// Swap: the GEMM is computed as y^T = w @ x^T, so that its M (the tile's tall side) is the output
// features rather than the 65-256 rows of a decode step.
template <class Tile, class Cluster, class Schedule, class EpilogueSchedule, bool Swap>
struct PdlGemm {
  using T = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;  // a [rows, K] row-major matrix read as K x rows
  using LayoutC = std::conditional_t<Swap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, LayoutC, 8, T, LayoutC, 8,
      EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA, 8, T, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // 0 on success; 1 shape not supported, 2 needs a workspace, 3 set-up failed, 4 launch failed.
  static int run(const void* x, const void* w, const void* c, void* y, int m, int n, int k, float beta,
                 cudaStream_t stream, bool pdl, int sms) {
    const int gm = Swap ? n : m, gn = Swap ? m : n;
    const T* a = static_cast<const T*>(Swap ? w : x);
    const T* b = static_cast<const T*>(Swap ? x : w);
    auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {gm, k, 1});
    auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {gn, k, 1});
    auto sc = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {gm, gn, 1});
    auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {gm, gn, 1});
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sms;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {gm, gn, k, 1}, {a, sa, b, sb},
                                  {{1.0f, beta}, static_cast<const T*>(c), sc, static_cast<T*>(y), sd}, hw};
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (Gemm::get_workspace_size(args) != 0) return 2;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return 3;
    return gemm.run(stream, nullptr, pdl) == cutlass::Status::kSuccess ? 0 : 4;
  }
};

#define PDL_GEMM_EXPORT(NAME, ...)                                                                    \
  extern "C" int NAME(const void* x, const void* w, const void* c, void* y, int m, int n, int k,      \
                      float beta, void* stream, int pdl, int sms) {                                   \
    return PdlGemm<__VA_ARGS__>::run(x, w, c, y, m, n, k, beta, static_cast<cudaStream_t>(stream),    \
                                     pdl != 0, sms);                                                  \
  }
