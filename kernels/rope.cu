// RoPE rotation by cos/sin tables (kernels/rope.hpp): one thread per (token, head, pair), the
// token's row of the tables read by position. Each product and each sum rounded to the dtype
// with the _rn intrinsics (no fused multiply-add), as LibTorch's mul, sub and add compute them.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/rope_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {

// x [T, H, R] with strides (sx_t, sx_h, 1); out [T, H, R] contiguous; tables [P, R/2].
template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const int64_t* __restrict__ positions, const T* __restrict__ cos_t,
                            const T* __restrict__ sin_t, T* __restrict__ out, int64_t n_pairs, int H, int half,
                            int64_t sx_t, int64_t sx_h, int64_t P, bool interleaved) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_pairs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / half;  // t * H + h
    const int p = int(i - row * half);
    const int64_t t = row / H, h = row - t * H;
    int64_t pos = positions[t];
    pos = pos < 0 ? 0 : (pos >= P ? P - 1 : pos);
    const float c = to_f(cos_t[pos * half + p]), s = to_f(sin_t[pos * half + p]);
    const T* xr = x + t * sx_t + h * sx_h;
    T* orow = out + row * 2 * half;
    const int j0 = interleaved ? 2 * p : p, j1 = interleaved ? 2 * p + 1 : p + half;
    const float x0 = to_f(xr[j0]), x1 = to_f(xr[j1]);
    // x0 c - x1 s and x1 c + x0 s: each product rounded to T, then the sum.
    auto r = [](float v) { return to_f(from_f<T>(v)); };
    const float x0c = r(__fmul_rn(x0, c)), x1s = r(__fmul_rn(x1, s));
    const float x1c = r(__fmul_rn(x1, c)), x0s = r(__fmul_rn(x0, s));
    orow[j0] = from_f<T>(__fsub_rn(x0c, x1s));
    orow[j1] = from_f<T>(__fadd_rn(x1c, x0s));
  }
}

template <typename T>
void launch(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t,
            bool interleaved, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), half = x.size(2) / 2, n_pairs = T_ * H * half;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n_pairs + kThreads - 1) / kThreads, 65535);
  rope_kernel<T><<<unsigned(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(x.data_ptr()), positions.data_ptr<int64_t>(), static_cast<const T*>(cos_t.data_ptr()),
      static_cast<const T*>(sin_t.data_ptr()), static_cast<T*>(out.data_ptr()), n_pairs, int(H), int(half), x.stride(0),
      x.stride(1), cos_t.size(0), interleaved);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void rope_rotate(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                 const at::Tensor& sin_table, bool interleaved, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  switch (x.scalar_type()) {
    case at::kFloat: launch<float>(x, positions, cos_table, sin_table, interleaved, out); break;
    case at::kBFloat16: launch<__nv_bfloat16>(x, positions, cos_table, sin_table, interleaved, out); break;
    case at::kHalf: launch<__half>(x, positions, cos_table, sin_table, interleaved, out); break;
    default: TORCH_CHECK(false, "rope_rotate: no kernel for dtype ", x.scalar_type());
  }
}

}  // namespace kiln::kernels::cuda
