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

// Row r of gate, up, dy and the outputs at r * its row stride (elements): one layout for the
// packed [M, 2F] projection (gate and up halves of one row) and for two separate [M, F] tensors.
template <class T>
struct Rows {
  const T* g;
  const T* u;
  int64_t gs, us;
};

template <class T>
__global__ void __launch_bounds__(kThreads) fwd(Rows<T> in, T* __restrict__ out, int64_t os, int64_t n_vec,
                                                int64_t F) {
  const int64_t fv = F / kVec;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / fv, c = (i % fv) * kVec;
    const Vec<T> g = *reinterpret_cast<const Vec<T>*>(in.g + r * in.gs + c);
    const Vec<T> u = *reinterpret_cast<const Vec<T>*>(in.u + r * in.us + c);
    Vec<T> o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const T s = from_f<T>(silu_f(to_f(g.v[j])));  // torch.silu, rounded
      o.v[j] = from_f<T>(to_f(s) * to_f(u.v[j]));   // * up, rounded
    }
    *reinterpret_cast<Vec<T>*>(out + r * os + c) = o;
  }
}

// kAct: also writes the forward's activation (rounded as fwd rounds it) to act_out, for a
// caller that recomputes it in the backward (swiglu_pair_backward's want_act).
template <class T, bool kAct>
__global__ void __launch_bounds__(kThreads) bwd(Rows<T> in, const T* __restrict__ dy, int64_t dys,
                                                T* __restrict__ dg_out, int64_t dgs, T* __restrict__ du_out,
                                                int64_t dus, T* __restrict__ act_out, int64_t n_vec, int64_t F) {
  const int64_t fv = F / kVec;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / fv, c = (i % fv) * kVec;
    const Vec<T> g = *reinterpret_cast<const Vec<T>*>(in.g + r * in.gs + c);
    const Vec<T> u = *reinterpret_cast<const Vec<T>*>(in.u + r * in.us + c);
    const Vec<T> d = *reinterpret_cast<const Vec<T>*>(dy + r * dys + c);
    Vec<T> dg, du, a;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_f(g.v[j]), dyv = to_f(d.v[j]);
      const T s = from_f<T>(silu_f(x));
      if (kAct) a.v[j] = from_f<T>(to_f(s) * to_f(u.v[j]));      // the forward's act
      du.v[j] = from_f<T>(dyv * to_f(s));                        // d up = dy * silu(gate)
      const T ds = from_f<T>(dyv * to_f(u.v[j]));                // d silu = dy * up
      dg.v[j] = from_f<T>(silu_grad_f(to_f(ds), x));             // d gate
    }
    *reinterpret_cast<Vec<T>*>(dg_out + r * dgs + c) = dg;
    *reinterpret_cast<Vec<T>*>(du_out + r * dus + c) = du;
    if (kAct) *reinterpret_cast<Vec<T>*>(act_out + r * F + c) = a;
  }
}

// The routed experts' backward with the combine weight folded in (kernels/swiglu.hpp,
// swiglu_routed_backward): a warp per row, each lane 8 columns at a time; act recomputed and
// rounded as fwd rounds it, dy = w * h in fp32, d up / d silu / d gate rounded as bwd rounds
// them, and the row's sum of h * act over the lanes in a fixed shuffle order.
template <class T>
__global__ void __launch_bounds__(kThreads) routed_bwd(const T* __restrict__ gu, const T* __restrict__ h,
                                                       const float* __restrict__ w_row, T* __restrict__ dgu,
                                                       T* __restrict__ act_w, float* __restrict__ dw_row, int64_t M,
                                                       int64_t F) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < M; r += int64_t(gridDim.x) * kWarps) {
    const float w = w_row[r];
    const T* g_r = gu + r * 2 * F;
    float dot = 0.f;
    for (int64_t c = int64_t(lane) * kVec; c < F; c += 32 * kVec) {
      const Vec<T> g = *reinterpret_cast<const Vec<T>*>(g_r + c);
      const Vec<T> u = *reinterpret_cast<const Vec<T>*>(g_r + F + c);
      const Vec<T> hv = *reinterpret_cast<const Vec<T>*>(h + r * F + c);
      Vec<T> dg, du, aw;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float x = to_f(g.v[j]), hf = to_f(hv.v[j]);
        const T s = from_f<T>(silu_f(x));
        const T a = from_f<T>(to_f(s) * to_f(u.v[j]));  // the forward's act
        dot += hf * to_f(a);
        aw.v[j] = from_f<T>(w * to_f(a));
        const float dyv = w * hf;
        du.v[j] = from_f<T>(dyv * to_f(s));
        const T ds = from_f<T>(dyv * to_f(u.v[j]));
        dg.v[j] = from_f<T>(silu_grad_f(to_f(ds), x));
      }
      *reinterpret_cast<Vec<T>*>(dgu + r * 2 * F + c) = dg;
      *reinterpret_cast<Vec<T>*>(dgu + r * 2 * F + F + c) = du;
      *reinterpret_cast<Vec<T>*>(act_w + r * F + c) = aw;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) dw_row[r] = dot;
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

namespace {
template <class T>
Rows<T> rows_of(const at::Tensor& g, const at::Tensor& u) {
  return Rows<T>{static_cast<const T*>(g.data_ptr()), static_cast<const T*>(u.data_ptr()), g.stride(0), u.stride(0)};
}

// gate, up [M, F] views (last dim contiguous); out [M, F].
void forward(const at::Tensor& g, const at::Tensor& u, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t M = g.size(0), F = g.size(1), n_vec = M * F / kVec;
  TORCH_CHECK(F % kVec == 0, "swiglu kernels: F = ", F, " is not a multiple of ", kVec);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(g.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    fwd<T><<<blocks_for(n_vec), kThreads, 0, stream>>>(rows_of<T>(g, u), static_cast<T*>(out.data_ptr()),
                                                       out.stride(0), n_vec, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// act: undefined, or [M, F] contiguous to receive the forward's activation too.
void backward(const at::Tensor& g, const at::Tensor& u, const at::Tensor& dy, at::Tensor& dg, at::Tensor& du,
              at::Tensor* act = nullptr) {
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t M = g.size(0), F = g.size(1), n_vec = M * F / kVec;
  TORCH_CHECK(F % kVec == 0 && dy.size(0) == M && dy.size(1) == F, "swiglu kernels: dy ", dy.sizes(), " for gate ",
              g.sizes());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(g.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto* a = act ? static_cast<T*>(act->data_ptr()) : nullptr;
    auto* k = act ? &bwd<T, true> : &bwd<T, false>;
    k<<<blocks_for(n_vec), kThreads, 0, stream>>>(rows_of<T>(g, u), static_cast<const T*>(dy.data_ptr()), dy.stride(0),
                                                  static_cast<T*>(dg.data_ptr()), dg.stride(0),
                                                  static_cast<T*>(du.data_ptr()), du.stride(0), a, n_vec, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace

void swiglu_packed_forward(const at::Tensor& gu, at::Tensor& out) {
  const int64_t F = gu.size(1) / 2;
  forward(gu.narrow(1, 0, F), gu.narrow(1, F, F), out);
}

void swiglu_packed_backward(const at::Tensor& gu, const at::Tensor& dy, at::Tensor& dgu) {
  const int64_t F = gu.size(1) / 2;
  auto dg = dgu.narrow(1, 0, F), du = dgu.narrow(1, F, F);
  backward(gu.narrow(1, 0, F), gu.narrow(1, F, F), dy, dg, du);
}

void swiglu_routed_backward(const at::Tensor& gu, const at::Tensor& h, const at::Tensor& w_row, at::Tensor& dgu,
                            at::Tensor& act_w, at::Tensor& dw_row) {
  const c10::cuda::CUDAGuard guard(gu.device());
  const int64_t M = gu.size(0), F = gu.size(1) / 2;
  TORCH_CHECK(F % kVec == 0 && h.size(0) == M && h.size(1) == F && w_row.numel() == M,
              "swiglu_routed_backward kernel: h ", h.sizes(), " and w_row ", w_row.sizes(), " for gu ", gu.sizes());
  if (M == 0) return;
  constexpr int64_t kWarps = kThreads / 32;
  const int64_t b = (M + kWarps - 1) / kWarps;
  const unsigned blocks = unsigned(b < 65535 * 16 ? b : 65535 * 16);  // grid-stride beyond
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch(gu.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    routed_bwd<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(gu.data_ptr()), static_cast<const T*>(h.data_ptr()), w_row.data_ptr<float>(),
        static_cast<T*>(dgu.data_ptr()), static_cast<T*>(act_w.data_ptr()), dw_row.data_ptr<float>(), M, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_pair_forward(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) { forward(gate, up, out); }

void swiglu_pair_backward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dy, at::Tensor& dgate,
                          at::Tensor& dup, at::Tensor* act) {
  backward(gate, up, dy, dgate, dup, act);
}

}  // namespace kiln::kernels::cuda
