// The fused log-prob head's target log-probs (kernels/lm_head_cuda.hpp): each row's logit at its
// target as an fp32 dot product, minus the row's logsumexp, in one pass, one warp per row. The
// GEMM's epilogue reduces whole rows and keeps no single logit in fp32; this reads the row's
// hidden state and the target's weight row (2 x D x 2 bytes) instead of the LibTorch composite's
// gather, two fp32 casts, product and sum (~30 D bytes a row, five launches). No LibTorch here.
#include <cuda_bf16.h>

#include <stdexcept>
#include <string>

#include "kernels/lm_head_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kWarps = 8;  // rows per block

// out[r] = sum_k float(h[r, k]) float(w[y, k]) - lse[r] for y = targets[r] in [0, V), else 0.
// Lane l adds the products of the 16-byte vectors l, l + 32, ... in order (fp32 fma), then the
// lanes' sums by a butterfly: a row's bits depend on D alone, not on N or the row's position.
__global__ void __launch_bounds__(kWarps * 32)
    target_logprobs(const __nv_bfloat16* __restrict__ hidden, const __nv_bfloat16* __restrict__ weight,
                    const int64_t* __restrict__ targets, const float* __restrict__ lse, float* __restrict__ out,
                    int64_t N, int64_t D, int64_t V) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // (whole warps: a warp is one row)
  const int64_t y = targets[row];
  if (y < 0 || y >= V) {
    if (lane == 0) out[row] = 0.f;
    return;
  }
  const auto* h = reinterpret_cast<const uint4*>(hidden + row * D);
  const auto* w = reinterpret_cast<const uint4*>(weight + y * D);
  float acc = 0.f;
  for (int64_t i = lane; i < D / 8; i += 32) {
    const uint4 a = h[i], b = w[i];
    const auto* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const auto* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fa = __bfloat1622float2(a2[j]), fb = __bfloat1622float2(b2[j]);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  if (lane == 0) out[row] = acc - lse[row];
}
}  // namespace

void lm_head_target_logprobs(const LmHeadTargetArgs& a) {
  if (a.N < 1) return;
  if (a.D < 8 || a.D % 8 || a.V < 1)
    throw std::runtime_error("lm_head_target_logprobs: D " + std::to_string(a.D) + ", V " + std::to_string(a.V) +
                             ": D must be a positive multiple of 8, V >= 1");
  const auto blocks = unsigned((a.N + kWarps - 1) / kWarps);
  target_logprobs<<<blocks, kWarps * 32, 0, static_cast<cudaStream_t>(a.stream)>>>(
      static_cast<const __nv_bfloat16*>(a.hidden), static_cast<const __nv_bfloat16*>(a.weight), a.targets, a.lse,
      a.out, a.N, a.D, a.V);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("lm_head_target_logprobs: launch failed: ") + cudaGetErrorString(e));
}

}  // namespace kiln::kernels::cuda
