// Router top-k: sigmoid + score-correction bias + K rounds of warp arg-max, one warp per token;
// optionally the chosen experts' weights (unbiased scores, normalised, scaled).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include "kernels/moe_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kMaxPerLane = 16;  // E <= 32 * 16 = 512
constexpr int kWarpsPerBlock = 8;

__global__ void router_topk_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                   int64_t* __restrict__ ids, float* __restrict__ weights, bool norm, float scale,
                                   int64_t T, int E, int K) {
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= T) return;
  float v[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = i * 32 + lane;  // coalesced: lanes read consecutive experts
    v[i] = e < E ? 1.f / (1.f + __expf(-logits[t * E + e])) + bias[e] : -INFINITY;
  }
  float sum = 0.f;  // lane 0: the chosen experts' unbiased scores, in k order
  for (int k = 0; k < K; ++k) {
    float best = -INFINITY;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = i * 32 + lane;
      if (e < E && (v[i] > best || (v[i] == best && e < best_e))) { best = v[i]; best_e = e; }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
    }
    if (lane == 0) {
      ids[t * K + k] = best_e;
      if (weights) {  // the unbiased score, sigmoid as LibTorch's: 1 / (1 + exp(-x)) in fp32
        const float sc = 1.f / (1.f + expf(-logits[t * E + best_e]));
        weights[t * K + k] = sc;
        sum += sc;
      }
    }
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (i * 32 + lane == best_e) v[i] = -INFINITY;  // compile-time index: stays in registers
  }
  if (weights && lane == 0)
    for (int k = 0; k < K; ++k) {
      const float w = norm ? weights[t * K + k] / (sum + 1e-20f) : weights[t * K + k];
      weights[t * K + k] = w * scale;
    }
}
}  // namespace

void router_topk(const at::Tensor& logits, const at::Tensor& bias, at::Tensor& ids, at::Tensor* weights, bool norm,
                 double scale) {
  const c10::cuda::CUDAGuard guard(logits.device());  // launch on the tensors' GPU, not the current one
  const int64_t T = logits.size(0);
  const int E = int(logits.size(1)), K = int(ids.size(1));
  TORCH_CHECK(E <= 32 * kMaxPerLane, "router_topk: at most ", 32 * kMaxPerLane, " experts, got ", E);
  if (T == 0) return;
  const dim3 grid(unsigned((T + kWarpsPerBlock - 1) / kWarpsPerBlock)), block(32 * kWarpsPerBlock);
  router_topk_kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
      logits.data_ptr<float>(), bias.data_ptr<float>(), ids.data_ptr<int64_t>(),
      weights ? weights->data_ptr<float>() : nullptr, norm, float(scale), T, E, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
