#include "pdl_gemm.cuh"
using namespace cute;
using namespace cutlass::gemm;
using namespace cutlass::epilogue;
// Two CTAs along M share (multicast) each weight tile.
PDL_GEMM_EXPORT(pingpong_64x128_cluster2, Shape<_64, _128, _64>, Shape<_2, _1, _1>, KernelTmaWarpSpecializedPingpong,
                TmaWarpSpecialized, false)
