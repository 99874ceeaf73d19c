// The fused log-prob head's pingpong schedule: CUTLASS 3's sm90 GEMM with 128x128x64 tiles, one
// per consumer warp group, one group's epilogue (the row reductions) running while the other's
// mainloop keeps the tensor cores busy, cluster 1x2 (the GEMM and its epilogue:
// kernels/lm_head_sm90.cuh; the entry: kernels/lm_head_sm90.cu). No LibTorch here: compile time.
#include "kernels/lm_head_sm90.cuh"

namespace kiln::kernels::cuda::lm_head_sm90 {
Partials run_pingpong(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  return run<Shape<_128, _128, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
      cutlass::epilogue::TmaWarpSpecialized>(a, alloc, alloc_ctx);
}
}  // namespace kiln::kernels::cuda::lm_head_sm90
