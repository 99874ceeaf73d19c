// Fused log-prob / entropy over the vocabulary: one block per row.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/dtype.cuh"
#include "kernels/logprobs_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 512;


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

template <class T> __device__ __forceinline__ float load_f(T v) { return to_f(v); }
template <> __device__ __forceinline__ float load_f(float v) { return v; }

// N values of K stored with one instruction (8 or 16 bytes).
template <class K, int N>
struct alignas(sizeof(K) * N) Pack {
  K v[N];
};

// 16-byte vectors per thread loaded before any is used: kUnroll loads in flight per thread
// (one per iteration kept the 16k resident threads of an H200 SM short of the bandwidth).
// Thread t still visits vectors t, t + kThreads, t + 2 kThreads, ... in that order, so each
// row's accumulation order, and its bits, do not depend on the unrolling.
constexpr int kUnroll = 4;

// z row-major [n, V] in T (fp32 logits from the GEMM, or 16-bit); keep: optional copy of z
// rounded to K (the model's dtype), for the backward.
template <class T, class K>
__global__ void __launch_bounds__(kThreads) fwd(const T* __restrict__ z, const int64_t* __restrict__ targets,
                                                float* logp, float* lse, float* ent, float* mean_z,
                                                K* __restrict__ keep, float* keep_lse, float* keep_mean_z, int64_t V) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const T* zr = z + row * V;
  K* kr = keep ? keep + row * V : nullptr;
  // a: the logits as given; a16: as kept (rounded to K), whose softmax the backward uses.
  Acc a{-INFINITY, 0.f, 0.f}, a16{-INFINITY, 0.f, 0.f};
  auto take_vec = [&](int64_t i, const uint4& u) {  // vector i: elements i*kVec ..
    const T* e = reinterpret_cast<const T*>(&u);
    if (kr) {
      Pack<K, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float x = load_f(e[j]);
        a = add(a, x);
        out.v[j] = from_f<K>(x);
        a16 = add(a16, to_f(out.v[j]));
      }
      reinterpret_cast<Pack<K, kVec>*>(kr)[i] = out;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) a = add(a, load_f(e[j]));
    }
  };
  if (V % kVec == 0) {  // 16-byte loads, kUnroll in flight
    const uint4* v = reinterpret_cast<const uint4*>(zr);
    const int64_t nv = V / kVec;
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < nv; i += kUnroll * kThreads) {
      uint4 u[kUnroll];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) u[r] = v[i + r * kThreads];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) take_vec(i + r * kThreads, u[r]);
    }
    for (; i < nv; i += kThreads) take_vec(i, v[i]);
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float x = load_f(zr[i]);
      a = add(a, x);
      if (kr) {
        const K r = from_f<K>(x);
        kr[i] = r;
        a16 = add(a16, to_f(r));
      }
    }
  }
  auto warp_merge = [](Acc x) {
    for (int o = 16; o > 0; o >>= 1) {
      Acc b{__shfl_xor_sync(0xffffffffu, x.m, o), __shfl_xor_sync(0xffffffffu, x.s, o),
            __shfl_xor_sync(0xffffffffu, x.sz, o)};
      x = merge(x, b);
    }
    return x;
  };
  a = warp_merge(a);
  a16 = warp_merge(a16);
  __shared__ Acc warps[kThreads / 32], warps16[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warps[warp] = a;
    warps16[warp] = a16;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc t = warps[0], t16 = warps16[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      t = merge(t, warps[w]);
      t16 = merge(t16, warps16[w]);
    }
    if (kr) {
      keep_lse[row] = t16.m + __logf(t16.s);
      if (keep_mean_z) keep_mean_z[row] = t16.sz / t16.s;
    }
    const float l = t.m + __logf(t.s);
    lse[row] = l;
    const int64_t y = targets[row];
    logp[row] = (y >= 0 && y < V) ? load_f(zr[y]) - l : 0.f;
    if (ent) {
      const float ez = t.sz / t.s;
      mean_z[row] = ez;
      ent[row] = l - ez;
    }
  }
}

// dz (in K, the model's dtype) from z in T. dz may be z (in place, T = K): each thread loads
// its elements before it stores them, and no thread reads another's (z and dz not restrict).
// Stores: one 8- or 16-byte store per vector (element-wise 2-byte stores made this kernel
// ~4x slower than its bytes at the copy rate).
template <class T, class K>
__global__ void __launch_bounds__(kThreads) bwd(const T* z, const int64_t* __restrict__ targets,
                                                const float* __restrict__ lse, const float* __restrict__ g_lp,
                                                const float* __restrict__ g_ent, const float* __restrict__ mean_z,
                                                K* dz, int64_t V) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const T* zr = z + row * V;
  K* dr = dz + row * V;
  const float l = lse[row], g = g_lp[row], ge = g_ent ? g_ent[row] : 0.f, mz = g_ent ? mean_z[row] : 0.f;
  const int64_t y = targets[row];
  auto one = [&](int64_t i, float zv) {
    const float p = __expf(zv - l);
    float d = -g * p;
    if (i == y) d += g;
    if (g_ent) d -= ge * p * (zv - mz);
    return from_f<K>(d);
  };
  auto vec = [&](int64_t i, const uint4& u) {
    const T* e = reinterpret_cast<const T*>(&u);
    Pack<K, kVec> o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) o.v[j] = one(i * kVec + j, load_f(e[j]));
    return o;
  };
  if (V % kVec == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(zr);
    auto* out = reinterpret_cast<Pack<K, kVec>*>(dr);
    const int64_t nv = V / kVec;
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < nv; i += kUnroll * kThreads) {
      uint4 u[kUnroll];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) u[r] = v[i + r * kThreads];  // all loads before any store
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) out[i + r * kThreads] = vec(i + r * kThreads, u[r]);
    }
    for (; i < nv; i += kThreads) {
      const uint4 u = v[i];
      out[i] = vec(i, u);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) dr[i] = one(i, load_f(zr[i]));
  }
}

// f(T{}, K{}) for z's dtype T (fp32, bf16, fp16) and the 16-bit output dtype K.
template <class F>
void dispatch(at::ScalarType t, at::ScalarType k, F f) {
  TORCH_CHECK(k == at::kBFloat16 || k == at::kHalf, "logprob kernels: output dtype ", k, " not supported (bf16, fp16)");
  TORCH_CHECK(t == at::kFloat || t == k, "logprob kernels: logits dtype ", t, " with output dtype ", k);
  if (k == at::kBFloat16) {
    if (t == at::kFloat) f(float{}, __nv_bfloat16{});
    else f(__nv_bfloat16{}, __nv_bfloat16{});
  } else {
    if (t == at::kFloat) f(float{}, __half{});
    else f(__half{}, __half{});
  }
}
}  // namespace

void logprob_forward(const at::Tensor& z, const at::Tensor& targets, at::Tensor& logp, at::Tensor& lse,
                     at::Tensor* entropy, at::Tensor* mean_z, at::Tensor* keep, at::Tensor* keep_lse,
                     at::Tensor* keep_mean_z, at::ScalarType model_dtype) {
  const c10::cuda::CUDAGuard guard(z.device());  // launch on the tensors' GPU, not the current one
  const int64_t n = z.size(0), V = z.size(1);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(z.scalar_type(), model_dtype, [&](auto t_tag, auto k_tag) {
    using T = decltype(t_tag);
    using K = decltype(k_tag);
    fwd<T, K><<<unsigned(n), kThreads, 0, stream>>>(
        static_cast<const T*>(z.data_ptr()), targets.data_ptr<int64_t>(), logp.data_ptr<float>(),
        lse.data_ptr<float>(), entropy ? entropy->data_ptr<float>() : nullptr,
        mean_z ? mean_z->data_ptr<float>() : nullptr, keep ? static_cast<K*>(keep->data_ptr()) : nullptr,
        keep_lse ? keep_lse->data_ptr<float>() : nullptr, keep_mean_z ? keep_mean_z->data_ptr<float>() : nullptr, V);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void logprob_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& g_lp,
                      const at::Tensor* g_ent, const at::Tensor* mean_z, at::Tensor& dz) {
  const c10::cuda::CUDAGuard guard(z.device());  // launch on the tensors' GPU, not the current one
  const int64_t n = z.size(0), V = z.size(1);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(z.scalar_type(), dz.scalar_type(), [&](auto t_tag, auto k_tag) {
    using T = decltype(t_tag);
    using K = decltype(k_tag);
    bwd<T, K><<<unsigned(n), kThreads, 0, stream>>>(static_cast<const T*>(z.data_ptr()), targets.data_ptr<int64_t>(),
                                                    lse.data_ptr<float>(), g_lp.data_ptr<float>(),
                                                    g_ent ? g_ent->data_ptr<float>() : nullptr,
                                                    mean_z ? mean_z->data_ptr<float>() : nullptr,
                                                    static_cast<K*>(dz.data_ptr()), V);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
