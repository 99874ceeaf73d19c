// The fused log-prob head's entry (kernels/lm_head_cuda.hpp): its cooperative schedule (CUTLASS
// 3's sm90 GEMM with 128x256x64 tiles, both consumer warp groups on one tile, cluster 1x2; the
// GEMM and its epilogue: kernels/lm_head_sm90.cuh), and the kernel that merges each row's tile
// partials into the two logsumexps. No LibTorch here: compile time.
#include "kernels/lm_head_sm90.cuh"

namespace kiln::kernels::cuda {

namespace lm_head_sm90 {
Partials run_cooperative(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  return run<Shape<_128, _256, _64>, Shape<_1, _2, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
      cutlass::epilogue::TmaWarpSpecializedCooperative>(a, alloc, alloc_ctx);
}

namespace {
constexpr int kRowsPerBlock = 32, kSlices = 32;  // a warp over 32 rows; 32 warps over the tile columns

// lse[r] = m + log s of row r's partials merged over the tile columns, and the same for kept (whose
// partials all have the row's reference as m: a plain sum):
// block (32 rows) x (32 slices), each thread merging every 32nd tile column of its row (coalesced:
// a warp reads 32 consecutive rows' pairs of one column; at V = 154880 ~38 a thread with the
// pingpong schedule's 128-wide tiles, ~19 with the cooperative one's 256), then the slices merged
// in order (a chunk of 1024 rows is only 32 blocks: the slices keep the loads in flight).
__global__ void merge_row_partials(const MaxSum* __restrict__ lse_p, const MaxSum* __restrict__ kept_p, int n_tiles,
                                   int64_t m_pad, int M, float* __restrict__ lse, float* __restrict__ kept_lse) {
  __shared__ MaxSum part[2][kSlices][kRowsPerBlock];
  const int r = blockIdx.x * kRowsPerBlock + threadIdx.x, slice = threadIdx.y;
  MergeMaxSum<MaxSum> merge;
  MaxSum a(0), b(0);  // empty
  if (r < M) {
#pragma unroll 4
    for (int j = slice; j < n_tiles; j += kSlices) {
      a = merge(a, lse_p[j * m_pad + r]);
      b = merge(b, kept_p[j * m_pad + r]);
    }
  }
  part[0][slice][threadIdx.x] = a;
  part[1][slice][threadIdx.x] = b;
  __syncthreads();
  if (slice == 0 && r < M) {
    for (int i = 1; i < kSlices; ++i) a = merge(a, part[0][i][threadIdx.x]), b = merge(b, part[1][i][threadIdx.x]);
    lse[r] = a.m + logf(a.s);
    kept_lse[r] = b.m + logf(b.s);
  }
}
}  // namespace
}  // namespace lm_head_sm90

void lm_head_probs_lse(const LmHeadArgs& a, LmHeadAlloc alloc, void* alloc_ctx) {
  if (a.N < 1 || a.V < 1 || a.D < 1 || a.V % 8 || a.D % 8 || a.N > (int64_t(1) << 31) - 1 ||
      a.V > (int64_t(1) << 31) - 1 || a.D > (int64_t(1) << 31) - 1)
    throw std::runtime_error("lm_head_probs_lse: N " + std::to_string(a.N) + ", V " + std::to_string(a.V) + ", D " +
                             std::to_string(a.D) + ": each must be in [1, 2^31), V and D multiples of 8");
  const auto p = a.pingpong ? lm_head_sm90::run_pingpong(a, alloc, alloc_ctx)
                            : lm_head_sm90::run_cooperative(a, alloc, alloc_ctx);
  const int M = int(a.N);
  const dim3 grid(unsigned((int64_t(M) + lm_head_sm90::kRowsPerBlock - 1) / lm_head_sm90::kRowsPerBlock)),
      block(lm_head_sm90::kRowsPerBlock, lm_head_sm90::kSlices);
  lm_head_sm90::merge_row_partials<<<grid, block, 0, static_cast<cudaStream_t>(a.stream)>>>(
      p.lse, p.kept, p.n_tiles, p.m_pad, M, a.lse, a.kept_lse);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("lm_head_probs_lse: row merge launch failed: ") + cudaGetErrorString(e));
}

}  // namespace kiln::kernels::cuda
