#include "pdl_gemm.cuh"
using namespace cute;
using namespace cutlass::gemm;
using namespace cutlass::epilogue;
PDL_GEMM_EXPORT(swap_pingpong_64x64, Shape<_64, _64, _128>, Shape<_1, _1, _1>, KernelTmaWarpSpecializedPingpong,
                TmaWarpSpecialized, true)
