// Checksum (and copy) in one pass: 16-byte loads, per-thread uint64 sums, one atomic per block.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "kernels/checksum_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long term(uint32_t word, int64_t i) {
  const uint32_t m = (uint32_t(uint64_t(i + 1) * 2654435761ull)) | 1u;
  return (unsigned long long)(word & 0xffffu) * m;
}

__global__ void __launch_bounds__(kThreads) checksum_copy_kernel(const uint16_t* __restrict__ src,
                                                                 uint16_t* __restrict__ dst, int64_t words,
                                                                 unsigned long long* out) {
  unsigned long long acc = 0;
  const bool vec = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (!dst || reinterpret_cast<uintptr_t>(dst) % 16 == 0);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t done = 0;
  if (vec) {
    const int64_t n8 = words / 8;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < n8; v += stride) {
      const uint4 u = s[v];
      if (d) d[v] = u;
      const uint32_t parts[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc += term(parts[j] & 0xffffu, v * 8 + 2 * j);
        acc += term(parts[j] >> 16, v * 8 + 2 * j + 1);
      }
    }
    done = n8 * 8;
  }
  for (int64_t i = done + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < words; i += stride) {
    const uint16_t w = src[i];
    if (dst) dst[i] = w;
    acc += term(w, i);
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

void checksum_copy(const void* src, void* dst, int64_t words, at::Tensor& out) {
  out.zero_();
  if (words == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((words / 8 + kThreads - 1) / kThreads, 8 * int64_t(sms)));
  checksum_copy_kernel<<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), words,
      reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
