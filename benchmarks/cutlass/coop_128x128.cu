#include "pdl_gemm.cuh"
using namespace cute;
using namespace cutlass::gemm;
using namespace cutlass::epilogue;
PDL_GEMM_EXPORT(coop_128x128, Shape<_128, _128, _64>, Shape<_1, _1, _1>, KernelTmaWarpSpecializedCooperative,
                TmaWarpSpecializedCooperative, false)
