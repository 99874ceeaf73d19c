// Checksum (and copy) in one pass: 16-byte loads, per-thread uint64 sums, one atomic per block.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "kernels/checksum_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long term(uint32_t word, int64_t i) {
  const uint32_t m = (uint32_t(i + 1) * 2654435761u) | 1u;  // mod 2^32
  return (unsigned long long)(word * m);                    // mod 2^32
}

// halves: uint16 count. Word i covers halves 2i and 2i+1 (the latter 0 past the end).
__global__ void __launch_bounds__(kThreads) checksum_copy_kernel(const uint16_t* __restrict__ src,
                                                                 uint16_t* __restrict__ dst, int64_t halves,
                                                                 unsigned long long* out) {
  unsigned long long acc = 0;
  const bool vec = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (!dst || reinterpret_cast<uintptr_t>(dst) % 16 == 0);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t done = 0;  // halves handled by the vector loop
  if (vec) {
    const int64_t n8 = halves / 8;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < n8; v += stride) {
      const uint4 u = s[v];
      if (d) d[v] = u;
      acc += term(u.x, 4 * v) + term(u.y, 4 * v + 1) + term(u.z, 4 * v + 2) + term(u.w, 4 * v + 3);
    }
    done = n8 * 8;
  }
  for (int64_t h = done + 2 * (int64_t(blockIdx.x) * kThreads + threadIdx.x); h < halves; h += 2 * stride) {
    const uint32_t lo = src[h], hi = h + 1 < halves ? src[h + 1] : 0u;
    if (dst) {
      dst[h] = uint16_t(lo);
      if (h + 1 < halves) dst[h + 1] = uint16_t(hi);
    }
    acc += term(lo | (hi << 16), h / 2);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ unsigned long long warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    atomicAdd(out, total);
  }
}
}  // namespace

void checksum_copy(const void* src, void* dst, int64_t halves, at::Tensor& out, bool zero) {
  const c10::cuda::CUDAGuard guard(out.device());  // launch on the tensors' GPU, not the current one
  if (zero) out.zero_();
  if (halves == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((halves / 8 + kThreads - 1) / kThreads, 8 * int64_t(sms)));
  checksum_copy_kernel<<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), halves,
      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
