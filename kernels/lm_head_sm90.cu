// The fused log-prob head's entry (kernels/lm_head_cuda.hpp) and its cooperative schedule: CUTLASS
// 3's sm90 GEMM with 128x256x64 tiles, both consumer warp groups on one tile, cluster 1x2
// (the GEMM and its epilogue: kernels/lm_head_sm90.cuh). No LibTorch here: compile time.
#include "kernels/lm_head_sm90.cuh"

namespace kiln::kernels::cuda {

namespace lm_head_sm90 {
void run_cooperative(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  run<Shape<_128, _256, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
      cutlass::epilogue::TmaWarpSpecializedCooperative>(a, alloc, alloc_ctx);
}
}  // namespace lm_head_sm90

void lm_head_logits_lse(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  if (a.N < 1 || a.V < 1 || a.D < 1 || a.V % 8 || a.D % 8 || a.N > (int64_t(1) << 31) - 1 ||
      a.V > (int64_t(1) << 31) - 1 || a.D > (int64_t(1) << 31) - 1)
    throw std::runtime_error("lm_head_logits_lse: N " + std::to_string(a.N) + ", V " + std::to_string(a.V) + ", D " +
                             std::to_string(a.D) + ": each must be in [1, 2^31), V and D multiples of 8");
  if (a.pingpong)
    lm_head_sm90::run_pingpong(a, alloc, alloc_ctx);
  else
    lm_head_sm90::run_cooperative(a, alloc, alloc_ctx);
}

}  // namespace kiln::kernels::cuda
