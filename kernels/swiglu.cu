// SwiGLU over a packed [M, 2F] gate/up projection, forward and backward (kernels/swiglu.hpp):
// one thread per 8 columns of a row, 16-byte loads and stores, each op in fp32 rounded to the
// storage dtype where LibTorch's silu, mul and silu_backward round.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/swiglu_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256, kVec = 8;  // 8 16-bit values = 16 bytes

template <class T>
struct alignas(16) Vec {
  T v[kVec];
};

// As LibTorch's CUDA silu and silu_backward compute them (opmath fp32).
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_grad_f(float dy, float x) {
  const float s = 1.f / (1.f + expf(-x));
  return dy * s * (1.f + x * (1.f - s));
}

template <class T>
__global__ void __launch_bounds__(kThreads) fwd(const T* __restrict__ gu, T* __restrict__ out, int64_t n_vec,
                                                int64_t F) {
  const int64_t fv = F / kVec;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / fv, c = (i % fv) * kVec;
    const Vec<T> g = *reinterpret_cast<const Vec<T>*>(gu + r * 2 * F + c);
    const Vec<T> u = *reinterpret_cast<const Vec<T>*>(gu + r * 2 * F + F + c);
    Vec<T> o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const T s = from_f<T>(silu_f(to_f(g.v[j])));  // torch.silu, rounded
      o.v[j] = from_f<T>(to_f(s) * to_f(u.v[j]));   // * up, rounded
    }
    *reinterpret_cast<Vec<T>*>(out + r * F + c) = o;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) bwd(const T* __restrict__ gu, const T* __restrict__ dy,
                                                T* __restrict__ dgu, int64_t n_vec, int64_t F) {
  const int64_t fv = F / kVec;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / fv, c = (i % fv) * kVec;
    const Vec<T> g = *reinterpret_cast<const Vec<T>*>(gu + r * 2 * F + c);
    const Vec<T> u = *reinterpret_cast<const Vec<T>*>(gu + r * 2 * F + F + c);
    const Vec<T> d = *reinterpret_cast<const Vec<T>*>(dy + r * F + c);
    Vec<T> dg, du;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_f(g.v[j]), dyv = to_f(d.v[j]);
      const T s = from_f<T>(silu_f(x));
      du.v[j] = from_f<T>(dyv * to_f(s));                        // d up = dy * silu(gate)
      const T ds = from_f<T>(dyv * to_f(u.v[j]));                // d silu = dy * up
      dg.v[j] = from_f<T>(silu_grad_f(to_f(ds), x));             // d gate
    }
    *reinterpret_cast<Vec<T>*>(dgu + r * 2 * F + c) = dg;
    *reinterpret_cast<Vec<T>*>(dgu + r * 2 * F + F + c) = du;
  }
}

unsigned blocks_for(int64_t n_vec) {
  const int64_t b = (n_vec + kThreads - 1) / kThreads;
  return unsigned(b < 65535 * 16 ? b : 65535 * 16);  // grid-stride beyond
}

template <class F>
void dispatch(at::ScalarType t, F f) {
  if (t == at::kBFloat16) f(__nv_bfloat16{});
  else if (t == at::kHalf) f(__half{});
  else TORCH_CHECK(false, "swiglu_packed kernels: dtype ", t, " not supported (bf16, fp16)");
}
}  // namespace

void swiglu_packed_forward(const at::Tensor& gu, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(gu.device());
  const int64_t M = gu.size(0), F = gu.size(1) / 2, n_vec = M * F / kVec;
  TORCH_CHECK(F % kVec == 0, "swiglu_packed_forward: F = ", F, " is not a multiple of ", kVec);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(gu.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    fwd<T><<<blocks_for(n_vec), kThreads, 0, stream>>>(static_cast<const T*>(gu.data_ptr()),
                                                       static_cast<T*>(out.data_ptr()), n_vec, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_packed_backward(const at::Tensor& gu, const at::Tensor& dy, at::Tensor& dgu) {
  const c10::cuda::CUDAGuard guard(gu.device());
  const int64_t M = gu.size(0), F = gu.size(1) / 2, n_vec = M * F / kVec;
  TORCH_CHECK(F % kVec == 0 && dy.size(0) == M && dy.size(1) == F, "swiglu_packed_backward: dy ", dy.sizes(),
              " for gu ", gu.sizes());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(gu.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    bwd<T><<<blocks_for(n_vec), kThreads, 0, stream>>>(static_cast<const T*>(gu.data_ptr()),
                                                       static_cast<const T*>(dy.data_ptr()),
                                                       static_cast<T*>(dgu.data_ptr()), n_vec, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
