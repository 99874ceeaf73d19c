// Fused log-prob / entropy over the vocabulary: one block per row.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/logprobs_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 512;

template <class T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half(v); }

// Online softmax state: max m, s = sum exp(z - m), sz = sum exp(z - m) z.
struct Acc {
  float m, s, sz;
};
__device__ __forceinline__ Acc merge(Acc a, Acc b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f, 0.f};
  const float fa = __expf(a.m - m), fb = __expf(b.m - m);
  return {m, a.s * fa + b.s * fb, a.sz * fa + b.sz * fb};
}
__device__ __forceinline__ Acc add(Acc a, float z) {
  if (z > a.m) {
    const float f = __expf(a.m - z);
    return {z, a.s * f + 1.f, a.sz * f + z};
  }
  const float e = __expf(z - a.m);
  return {a.m, a.s + e, a.sz + e * z};
}

template <class T>
__global__ void __launch_bounds__(kThreads) fwd(const T* __restrict__ z, const int64_t* __restrict__ targets,
                                                float* logp, float* lse, float* ent, float* mean_z, int64_t V) {
  const int64_t row = blockIdx.x;
  const T* zr = z + row * V;
  Acc a{-INFINITY, 0.f, 0.f};
  if (V % 8 == 0) {  // 16-byte loads of 8 values
    const uint4* v = reinterpret_cast<const uint4*>(zr);
    for (int64_t i = threadIdx.x; i < V / 8; i += kThreads) {
      uint4 u = v[i];
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int j = 0; j < 8; ++j) a = add(a, to_f(e[j]));
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) a = add(a, to_f(zr[i]));
  }
  for (int o = 16; o > 0; o >>= 1) {
    Acc b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o),
          __shfl_xor_sync(0xffffffffu, a.sz, o)};
    a = merge(a, b);
  }
  __shared__ Acc warps[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc t = warps[0];
    for (int w = 1; w < kThreads / 32; ++w) t = merge(t, warps[w]);
    const float l = t.m + __logf(t.s);
    lse[row] = l;
    const int64_t y = targets[row];
    logp[row] = (y >= 0 && y < V) ? to_f(zr[y]) - l : 0.f;
    if (ent) {
      const float ez = t.sz / t.s;
      mean_z[row] = ez;
      ent[row] = l - ez;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) bwd(const T* __restrict__ z, const int64_t* __restrict__ targets,
                                                const float* __restrict__ lse, const float* __restrict__ g_lp,
                                                const float* __restrict__ g_ent, const float* __restrict__ mean_z,
                                                T* __restrict__ dz, int64_t V) {
  const int64_t row = blockIdx.x;
  const T* zr = z + row * V;
  T* dr = dz + row * V;
  const float l = lse[row], g = g_lp[row], ge = g_ent ? g_ent[row] : 0.f, mz = g_ent ? mean_z[row] : 0.f;
  const int64_t y = targets[row];
  auto one = [&](int64_t i, float zv) {
    const float p = __expf(zv - l);
    float d = -g * p;
    if (i == y) d += g;
    if (g_ent) d -= ge * p * (zv - mz);
    return from_f<T>(d);
  };
  if (V % 8 == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(zr);
    uint4* out = reinterpret_cast<uint4*>(dr);
    for (int64_t i = threadIdx.x; i < V / 8; i += kThreads) {
      uint4 u = v[i], w;
      const T* e = reinterpret_cast<const T*>(&u);
      T* o = reinterpret_cast<T*>(&w);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = one(i * 8 + j, to_f(e[j]));
      out[i] = w;
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) dr[i] = one(i, to_f(zr[i]));
  }
}

template <class F>
void dispatch(at::ScalarType t, F f) {
  switch (t) {
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    default: TORCH_CHECK(false, "logprob kernels: dtype ", t, " not supported (bf16, fp16)");
  }
}
}  // namespace

void logprob_forward(const at::Tensor& z, const at::Tensor& targets, at::Tensor& logp, at::Tensor& lse,
                     at::Tensor* entropy, at::Tensor* mean_z) {
  const int64_t n = z.size(0), V = z.size(1);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(z.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    fwd<T><<<unsigned(n), kThreads, 0, stream>>>(static_cast<const T*>(z.data_ptr()), targets.data_ptr<int64_t>(),
                                                 logp.data_ptr<float>(), lse.data_ptr<float>(),
                                                 entropy ? entropy->data_ptr<float>() : nullptr,
                                                 mean_z ? mean_z->data_ptr<float>() : nullptr, V);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void logprob_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& g_lp,
                      const at::Tensor* g_ent, const at::Tensor* mean_z, at::Tensor& dz) {
  const int64_t n = z.size(0), V = z.size(1);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(z.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    bwd<T><<<unsigned(n), kThreads, 0, stream>>>(static_cast<const T*>(z.data_ptr()), targets.data_ptr<int64_t>(),
                                                 lse.data_ptr<float>(), g_lp.data_ptr<float>(),
                                                 g_ent ? g_ent->data_ptr<float>() : nullptr,
                                                 mean_z ? mean_z->data_ptr<float>() : nullptr,
                                                 static_cast<T*>(dz.data_ptr()), V);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
