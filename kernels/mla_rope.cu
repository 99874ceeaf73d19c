// MLA's query, key and value in training (kernels/mla_rope.hpp): one thread per 16-byte vector
// of an output row, nope and value vectors copied, rope vectors rotated with the token's cos/sin
// rows. The forward rotation rounds as kernels/rope.cu does (each product rounded to the dtype,
// then the sum; no fused multiply-add), so its bits are the reference's; the backward's
// transpose rotation (sin negated) and the sum of k_pe's gradient over heads run in fp32 and
// round once.
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
#include "kernels/mla_rope_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256;

template <class T>
struct alignas(16) Vec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

template <class T>
__device__ __forceinline__ Vec<T> load(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}
template <class T>
__device__ __forceinline__ void store(T* p, const Vec<T>& v) {
  *reinterpret_cast<Vec<T>*>(p) = v;
}

// The token's tables and layout of the rope part.
template <class T>
struct Rope {
  const int64_t* pos;
  const T* cos;
  const T* sin;
  int64_t P;
  int R;  // rope dims; pairs R/2
  bool interleaved;
  __device__ __forceinline__ int64_t row(int64_t t) const {
    int64_t p = pos[t];
    return (p < 0 ? 0 : (p >= P ? P - 1 : p)) * (R / 2);
  }
  // Index, within the rope part, of the vector holding the partner elements of the vector at
  // rope offset j (non-interleaved pairs (i, i + R/2)); interleaved pairs lie within a vector.
  __device__ __forceinline__ int partner(int j) const { return j < R / 2 ? j + R / 2 : j - R / 2; }
};

// Rotates the vector x at rope offset j (xp: its partner vector when not interleaved), as
// rope.cu: y0 = x0 c - x1 s, y1 = x1 c + x0 s, each product rounded to T, then the sum.
// kTranspose: the rotation's transpose (s negated) in fp32, rounded once (the backward).
template <class T, bool kTranspose>
__device__ __forceinline__ Vec<T> rotate(const float* x, const float* xp, int j, const T* crow, const T* srow,
                                         const Rope<T>& r) {
  constexpr int n = Vec<T>::n;
  auto rd = [](float v) { return to_f(from_f<T>(v)); };
  Vec<T> y;
#pragma unroll
  for (int e = 0; e < n; ++e) {
    float x0, x1;
    int pair;
    bool first;
    if (r.interleaved) {
      first = (e % 2) == 0;
      x0 = first ? x[e] : x[e - 1];
      x1 = first ? x[e + 1 < n ? e + 1 : e] : x[e];
      pair = (j + e) / 2;
    } else {
      first = j < r.R / 2;
      x0 = first ? x[e] : xp[e];
      x1 = first ? xp[e] : x[e];
      pair = (first ? j : j - r.R / 2) + e;
    }
    const float c = to_f(crow[pair]), s = to_f(srow[pair]);
    float out;
    if (kTranspose) {
      // each product and the sum rounded apart (no FMA contraction): the same bits in every kernel
      // that rotates back, and the reference's (rotate_transpose_ref: ATen's mul, then add)
      out = first ? __fadd_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)) : __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
    } else {
      out = first ? __fsub_rn(rd(__fmul_rn(x0, c)), rd(__fmul_rn(x1, s)))
                  : __fadd_rn(rd(__fmul_rn(x1, c)), rd(__fmul_rn(x0, s)));
    }
    y.v[e] = from_f<T>(out);
  }
  return y;
}

template <class T>
__device__ __forceinline__ void widen(const Vec<T>& a, float* f) {
#pragma unroll
  for (int e = 0; e < Vec<T>::n; ++e) f[e] = to_f(a.v[e]);
}

// The row kernels below run on a grid of (token blocks, heads) with blocks of (vectors of a
// row) x (tokens): thread (v, y) of block (b, h) handles vector v of token b * blockDim.y + y,
// head h. No index is divided (64-bit division is emulated, 32-bit costs ~20 instructions: with
// one 16-byte vector a thread, a grid-stride loop with divisions held these copies near half
// the H200's copy rate).

// out [T*H, N+R] contiguous from in (row t, head h at t*st + h*sh): vpr vectors a row, the
// first nv of them copied.
template <class T, bool kTranspose>
__global__ void __launch_bounds__(kThreads) rope_q_kernel(const T* __restrict__ in, int64_t st, int64_t sh, T* __restrict__ out, Rope<T> r,
                              int64_t T_, int nv) {
  constexpr int n = Vec<T>::n;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= T_) return;
  const int h = blockIdx.y, H = gridDim.y, v = threadIdx.x, vpr = blockDim.x;
  const T* src = in + t * st + h * sh;
  T* dst = out + ((t * H + h) * vpr + v) * n;
  if (v < nv) {
    store(dst, load(src + v * n));
    return;
  }
  const int j = (v - nv) * n;
  const T* rope = src + nv * n;
  float x[n], xp[n];
  widen(load(rope + j), x);
  if (!r.interleaved) widen(load(rope + r.partner(j)), xp);
  const int64_t o = r.row(t);
  store(dst, rotate<T, kTranspose>(x, xp, j, r.cos + o, r.sin + o, r));
}

// q's rope part rotated in place (row t, head h at t*st + h*sh; the rope part from element nv*n):
// thread x of (blockDim.x) handles one rope vector when the pairs are interleaved (its pairs lie
// within it), else the pair of vectors j and j + R/2 (each reads both before either is written:
// no thread reads what another writes).
template <class T, bool kTranspose>
__global__ void __launch_bounds__(kThreads) rope_q_inplace_kernel(T* __restrict__ q, int64_t st, int64_t sh,
                                                                  Rope<T> r, int64_t T_, int nv) {
  constexpr int n = Vec<T>::n;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= T_) return;
  T* rope = q + t * st + int64_t(blockIdx.y) * sh + int64_t(nv) * n;
  const int64_t o = r.row(t);
  const int j = int(threadIdx.x) * n;
  float a[n], b[n];
  widen(load(rope + j), a);
  if (r.interleaved) {
    store(rope + j, rotate<T, kTranspose>(a, a, j, r.cos + o, r.sin + o, r));
    return;
  }
  const int j2 = j + r.R / 2;
  widen(load(rope + j2), b);
  const Vec<T> y = rotate<T, kTranspose>(a, b, j, r.cos + o, r.sin + o, r);
  const Vec<T> y2 = rotate<T, kTranspose>(b, a, j2, r.cos + o, r.sin + o, r);
  store(rope + j, y);
  store(rope + j2, y2);
}

// k [T*H, N+R] and v [T*H, V] contiguous from kv (row t, head h at t*st + h*sh; nope then
// value) and k_pe (row t at t*pst): nv + rv + vv vectors a (t, h). With skip = nv (kv unread,
// vv = 0), only k's rope vectors: its no-position part is already in place.
template <class T>
__global__ void __launch_bounds__(kThreads) rope_kv_forward(const T* __restrict__ kv, int64_t st, int64_t sh, const T* __restrict__ kpe,
                                int64_t pst, T* __restrict__ k, T* __restrict__ vout, Rope<T> r, int64_t T_, int nv,
                                int rv, int skip) {
  constexpr int n = Vec<T>::n;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= T_) return;
  const int h = blockIdx.y, H = gridDim.y, v = int(threadIdx.x) + skip, vv = int(blockDim.x) + skip - nv - rv;
  const int64_t row = t * H + h;
  const T* src = kv + t * st + h * sh;
  if (v < nv) {
    store(k + (row * (nv + rv) + v) * n, load(src + v * n));
  } else if (v < nv + rv) {
    const int j = (v - nv) * n;
    const T* p = kpe + t * pst;
    float x[n], xp[n];
    widen(load(p + j), x);
    if (!r.interleaved) widen(load(p + r.partner(j)), xp);
    const int64_t o = r.row(t);
    store(k + (row * (nv + rv) + v) * n, rotate<T, false>(x, xp, j, r.cos + o, r.sin + o, r));
  } else {
    const int w = v - nv - rv;
    store(vout + (row * vv + w) * n, load(src + int64_t(nv + w) * n));
  }
}

// dkv [T*H, N+V] contiguous = [dk[..., :N] | dv]: nv + vv vectors a (t, h).
template <class T>
__global__ void __launch_bounds__(kThreads) rope_kv_dkv(const T* __restrict__ dk, int64_t kst, int64_t ksh, const T* __restrict__ dv,
                            int64_t vst, int64_t vsh, T* __restrict__ dkv, int64_t T_, int nv) {
  constexpr int n = Vec<T>::n;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= T_) return;
  const int h = blockIdx.y, H = gridDim.y, v = threadIdx.x, per = blockDim.x;
  const T* src = v < nv ? dk + t * kst + h * ksh + int64_t(v) * n : dv + t * vst + h * vsh + int64_t(v - nv) * n;
  store(dkv + ((t * H + h) * per + v) * n, load(src));
}

// dk_pe [T, R] = rotation^T(sum over h of dk[t, h, N:]) in fp32: one thread per (t, rope vector).
template <class T>
__global__ void __launch_bounds__(kThreads) rope_kv_dkpe(const T* __restrict__ dk, int64_t kst, int64_t ksh,
                                                         T* __restrict__ dkpe, Rope<T> r, int64_t n_vec, int H,
                                                         int nv, int rv) {
  constexpr int n = Vec<T>::n;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n_vec; i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / rv;
    const int j = int(i - t * rv) * n;
    float x[n] = {}, xp[n] = {};
    const T* base = dk + t * kst + int64_t(nv) * n;
    for (int h = 0; h < H; ++h) {
      float a[n];
      widen(load(base + h * ksh + j), a);
#pragma unroll
      for (int e = 0; e < n; ++e) x[e] += a[e];
      if (!r.interleaved) {
        widen(load(base + h * ksh + r.partner(j)), a);
#pragma unroll
        for (int e = 0; e < n; ++e) xp[e] += a[e];
      }
    }
    const int64_t o = r.row(t);
    store(dkpe + t * r.R + j, rotate<T, true>(x, xp, j, r.cos + o, r.sin + o, r));
  }
}

unsigned blocks_for(int64_t n_vec) {
  const int64_t b = (n_vec + kThreads - 1) / kThreads;
  return unsigned(std::min<int64_t>(std::max<int64_t>(b, 1), int64_t(1) << 20));  // grid-stride beyond
}

// Blocks of vpr x (tokens) threads, at most kThreads (vpr <= kThreads: the callers' check); a
// grid of (token blocks, H).
struct RowGrid {
  dim3 grid, block;
};
RowGrid row_grid(int64_t T, int64_t H, int vpr) {
  const int ty = std::max(1, kThreads / vpr);
  return RowGrid{dim3(unsigned((T + ty - 1) / ty), unsigned(H)), dim3(unsigned(vpr), unsigned(ty))};
}

template <class T>
Rope<T> rope_of(const at::Tensor& positions, const at::Tensor& cos_t, const at::Tensor& sin_t, bool interleaved) {
  return Rope<T>{positions.data_ptr<int64_t>(), static_cast<const T*>(cos_t.data_ptr()),
                 static_cast<const T*>(sin_t.data_ptr()), cos_t.size(0), int(cos_t.size(1) * 2), interleaved};
}
}  // namespace

void mla_rope_q(const at::Tensor& in, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                const at::Tensor& sin_table, bool interleaved, bool inverse, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(in.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(in.scalar_type(), "mla_rope_q", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const int H = int(in.size(1)), vpr = int(in.size(2) / n), nv = int(nope_dim / n);
    const auto r = rope_of<T>(positions, cos_table, sin_table, interleaved);
    const auto* src = static_cast<const T*>(in.data_ptr());
    auto* dst = static_cast<T*>(out.data_ptr());
    const auto g = row_grid(in.size(0), H, vpr);
    if (inverse)
      rope_q_kernel<T, true><<<g.grid, g.block, 0, stream>>>(src, in.stride(0), in.stride(1), dst, r, in.size(0), nv);
    else
      rope_q_kernel<T, false><<<g.grid, g.block, 0, stream>>>(src, in.stride(0), in.stride(1), dst, r, in.size(0), nv);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_rope_q_inplace(at::Tensor& q, int64_t nope_dim, const at::Tensor& positions, const at::Tensor& cos_table,
                        const at::Tensor& sin_table, bool interleaved, bool inverse) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(q.scalar_type(), "mla_rope_q_", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const int64_t R = q.size(2) - nope_dim;
    const int H = int(q.size(1)), nv = int(nope_dim / n), bx = int(interleaved ? R / n : R / (2 * n));
    const auto r = rope_of<T>(positions, cos_table, sin_table, interleaved);
    const auto g = row_grid(q.size(0), H, bx);
    auto* p = static_cast<T*>(q.data_ptr());
    if (inverse)
      rope_q_inplace_kernel<T, true><<<g.grid, g.block, 0, stream>>>(p, q.stride(0), q.stride(1), r, q.size(0), nv);
    else
      rope_q_inplace_kernel<T, false><<<g.grid, g.block, 0, stream>>>(p, q.stride(0), q.stride(1), r, q.size(0), nv);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_rope_kv_forward(const at::Tensor& kv, const at::Tensor& k_pe, int64_t nope_dim, const at::Tensor& positions,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& k,
                         at::Tensor& v) {
  const c10::cuda::CUDAGuard guard(kv.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(kv.scalar_type(), "mla_rope_kv", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const int H = int(kv.size(1)), nv = int(nope_dim / n), rv = int(k_pe.size(1) / n), vv = int(v.size(2) / n);
    const auto g = row_grid(kv.size(0), H, nv + rv + vv);
    rope_kv_forward<T><<<g.grid, g.block, 0, stream>>>(
        static_cast<const T*>(kv.data_ptr()), kv.stride(0), kv.stride(1), static_cast<const T*>(k_pe.data_ptr()),
        k_pe.stride(0), static_cast<T*>(k.data_ptr()), static_cast<T*>(v.data_ptr()),
        rope_of<T>(positions, cos_table, sin_table, interleaved), kv.size(0), nv, rv, 0);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_rope_kv_forward_rope(const at::Tensor& k_pe, int64_t nope_dim, const at::Tensor& positions,
                              const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& k) {
  const c10::cuda::CUDAGuard guard(k.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(k.scalar_type(), "mla_rope_kv", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const int H = int(k.size(1)), nv = int(nope_dim / n), rv = int(k_pe.size(1) / n);
    const auto g = row_grid(k.size(0), H, rv);
    rope_kv_forward<T><<<g.grid, g.block, 0, stream>>>(
        nullptr, 0, 0, static_cast<const T*>(k_pe.data_ptr()), k_pe.stride(0), static_cast<T*>(k.data_ptr()), nullptr,
        rope_of<T>(positions, cos_table, sin_table, interleaved), k.size(0), nv, rv, nv);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_rope_kv_backward(const at::Tensor& dk, const at::Tensor& dv, int64_t nope_dim, const at::Tensor& positions,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, bool interleaved, at::Tensor& dkv,
                          at::Tensor& dk_pe) {
  const c10::cuda::CUDAGuard guard(dk.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_floating(dk.scalar_type(), "mla_rope_kv backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const int H = int(dk.size(1)), nv = int(nope_dim / n), rv = int(dk_pe.size(1) / n);
    const int64_t T_ = dk.size(0), n_pe = T_ * rv;
    if (dkv.defined()) {
      const int vv = int(dv.size(2) / n);
      const auto g = row_grid(T_, H, nv + vv);
      rope_kv_dkv<T><<<g.grid, g.block, 0, stream>>>(static_cast<const T*>(dk.data_ptr()), dk.stride(0), dk.stride(1),
                                                     static_cast<const T*>(dv.data_ptr()), dv.stride(0), dv.stride(1),
                                                     static_cast<T*>(dkv.data_ptr()), T_, nv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    rope_kv_dkpe<T><<<blocks_for(n_pe), kThreads, 0, stream>>>(static_cast<const T*>(dk.data_ptr()), dk.stride(0),
                                                               dk.stride(1), static_cast<T*>(dk_pe.data_ptr()),
                                                               rope_of<T>(positions, cos_table, sin_table, interleaved),
                                                               n_pe, H, nv, rv);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
