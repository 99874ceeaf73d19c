// Rows times their fp32 factors (kernels/scale_rows.hpp): a thread per 8 elements of a row (one
// 16-byte load of bf16/fp16, two of fp32), the factor read once per 8, the products rounded to
// out's dtype and stored as 16 or 32 bytes; grid-stride over the N * D / 8 groups. x and out not
// __restrict__: out may be x itself (each thread reads its 8 elements before writing them).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/dtype_dispatch.cuh"
#include "kernels/scale_rows_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256;

template <class T>
struct alignas(16) Vec8 {  // 8 elements: 16 bytes (bf16, fp16) or 32 (fp32, two 16-byte halves)
  T v[8];
};

template <class T>
__device__ __forceinline__ Vec8<T> load8(const T* p) {
  if constexpr (sizeof(T) == 4) {
    Vec8<T> r;
    *reinterpret_cast<float4*>(&r.v[0]) = *reinterpret_cast<const float4*>(p);
    *reinterpret_cast<float4*>(&r.v[4]) = *reinterpret_cast<const float4*>(p + 4);
    return r;
  } else {
    return *reinterpret_cast<const Vec8<T>*>(p);
  }
}

template <class T>
__device__ __forceinline__ void store8(T* p, const Vec8<T>& r) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = *reinterpret_cast<const float4*>(&r.v[0]);
    *reinterpret_cast<float4*>(p + 4) = *reinterpret_cast<const float4*>(&r.v[4]);
  } else {
    *reinterpret_cast<Vec8<T>*>(p) = r;
  }
}

template <class TI, class TO>
__global__ void __launch_bounds__(kThreads) scale_rows_kernel(const TI* x, const float* __restrict__ a, TO* out,
                                                              int64_t groups,
                                                              int64_t groups_per_row) {
  for (int64_t g = int64_t(blockIdx.x) * kThreads + threadIdx.x; g < groups; g += int64_t(gridDim.x) * kThreads) {
    const float s = a[g / groups_per_row];
    const Vec8<TI> v = load8(x + g * 8);
    Vec8<TO> o;
#pragma unroll
    for (int e = 0; e < 8; ++e) o.v[e] = from_f<TO>(__fmul_rn(to_f(v.v[e]), s));
    store8(out + g * 8, o);
  }
}

}  // namespace

void scale_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t groups = x.numel() / 8, per_row = x.size(1) / 8;
  if (groups == 0) return;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, int64_t(sms) * 16);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(x.scalar_type(), "scale_rows", [&](auto ti) {
    dispatch_floating(out.scalar_type(), "scale_rows", [&](auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      scale_rows_kernel<TI, TO><<<unsigned(blocks), kThreads, 0, stream>>>(
          static_cast<const TI*>(x.data_ptr()), a.data_ptr<float>(), static_cast<TO*>(out.data_ptr()), groups, per_row);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
