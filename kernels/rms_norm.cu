// Fused RMSNorm kernels: one block per row, fp32 accumulation, warp-shuffle reductions.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/add.h>
#include <ATen/ops/sum.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/alignment.hpp"
#include "kernels/dtype.cuh"
#include "kernels/dtype_dispatch.cuh"
#include "kernels/rms_norm_cuda.hpp"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256;

struct RmsNormParams {  // passed by value
  const void* x;
  const void* w;
  const void* dy;
  void* y;      // forward output / backward dx
  float* rstd;
  float* dw;    // backward: fp32 accumulator [D]
  int64_t rows, dim;
  float eps;
  // The warp kernels' residual forms (null: none). Forward: x + r rounded to T (at::add's
  // value) is normalised and written to s. Backward: dres added to dx after dx's rounding, and
  // the sum rounded (autograd's sum of the two gradients).
  const void* r = nullptr;
  void* s = nullptr;
  const void* dres = nullptr;
  int64_t xs = 0;  // x's row stride in elements (the warp kernels; the block kernels read x contiguous)
};


__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __shared__ float total;
  if (threadIdx.x == 0) total = v;
  __syncthreads();
  return total;
}

template <class T>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd(RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.dim;
  const T* w = static_cast<const T*>(p.w);
  T* y = static_cast<T*>(p.y) + row * p.dim;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
    float v = to_f(x[i]);
    ss += v * v;
  }
  const float rstd = rsqrtf(block_sum(ss) / float(p.dim) + p.eps);
  if (threadIdx.x == 0) p.rstd[row] = rstd;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
    T normed = from_f<T>(to_f(x[i]) * rstd);  // rounded to x's dtype before the weight, as transformers
    y[i] = from_f<T>(to_f(w[i]) * to_f(normed));
  }
}

// Grid-stride over rows: each block accumulates its rows' dw = sum(dy * n) in shared memory
// (each thread owns its columns: no atomics, no contention) and writes one partial row;
// the host sums the [blocks, D] partials.
template <class T>
__global__ void __launch_bounds__(kThreads) rms_norm_bwd(RmsNormParams p) {
  extern __shared__ float dw_acc[];  // [dim]
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) dw_acc[i] = 0.f;
  const T* w = static_cast<const T*>(p.w);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.dim;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dim;
    T* dx = static_cast<T*>(p.y) + row * p.dim;
    const float rstd = p.rstd[row];
    float dot = 0.f;  // sum(dn * n)
    for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
      const float n = to_f(x[i]) * rstd, g = to_f(dy[i]);
      dot += g * to_f(w[i]) * n;
      dw_acc[i] += g * n;
    }
    const float mean_dot = block_sum(dot) / float(p.dim);
    for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
      const float n = to_f(x[i]) * rstd;
      dx[i] = from_f<T>(rstd * (to_f(dy[i]) * to_f(w[i]) - n * mean_dot));
    }
  }
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) p.dw[blockIdx.x * p.dim + i] = dw_acc[i];
}

// The backward with a warp per row: each lane holds VPL 16-byte vectors of the row (x and dy in
// registers, loaded once; its columns of w read again from L1), so a row is read once and its
// dot product is a warp reduction (no block barrier per row). Each warp accumulates dw for its
// rows in its own slice of shared memory (a lane owns its columns: no atomics), in row order; at
// the end the block adds its warps' slices in warp order (the same sums on every run) and writes
// one partial row, as rms_norm_bwd does.
// History: the first kernel read 2-byte elements twice per row (~64 us for 8192 x 2048 bf16 on
// the H200, ~2.5x its bytes at the copy rate); the next kept w and dw in registers too (255
// registers and spills at 8 vectors a lane, one block of 8 warps an SM: 82-90 us for the
// residual form at 8192 x 2048 on the H100, ~1.5 TB/s). A slice's element e of vector v sits at
// float4 ((e / 4) * nvec + v), lane e % 4: a warp's 16-byte accesses are consecutive, no bank
// conflicts.
template <class T>
struct alignas(16) NVec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

template <class T, int VPL>
__global__ void __launch_bounds__(kThreads, 2) rms_norm_bwd_warp(RmsNormParams p) {
  constexpr int n = NVec<T>::n, kWarpsB = kThreads / 32, kQuads = n / 4;
  extern __shared__ float4 slices[];  // [kWarpsB][kQuads * nvec] float4: each warp's dw
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nvec = int(p.dim / n);
  float4* mine = slices + int64_t(warp) * kQuads * nvec;
  for (int i = lane; i < kQuads * nvec; i += 32) mine[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncwarp();
  const T* w = static_cast<const T*>(p.w);
  for (int64_t row = int64_t(blockIdx.x) * kWarpsB + warp; row < p.rows; row += int64_t(gridDim.x) * kWarpsB) {
    const T* x = static_cast<const T*>(p.x) + row * p.xs;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dim;
    T* dx = static_cast<T*>(p.y) + row * p.dim;
    NVec<T> xv[VPL], gv[VPL];
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int v = lane + 32 * j;
      if (v < nvec) {
        xv[j] = *reinterpret_cast<const NVec<T>*>(x + int64_t(v) * n);
        gv[j] = *reinterpret_cast<const NVec<T>*>(dy + int64_t(v) * n);
      }
    }
    const float rstd = p.rstd[row];
    float dot = 0.f;  // sum(dn * n)
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int v = lane + 32 * j;
      if (v < nvec) {
        const NVec<T> wv = *reinterpret_cast<const NVec<T>*>(w + int64_t(v) * n);
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
          float4 a = mine[q * nvec + v];
          float* af = reinterpret_cast<float*>(&a);
#pragma unroll
          for (int e4 = 0; e4 < 4; ++e4) {
            const int e = q * 4 + e4;
            const float nn = to_f(xv[j].v[e]) * rstd, g = to_f(gv[j].v[e]);
            dot += g * to_f(wv.v[e]) * nn;
            af[e4] += g * nn;
          }
          mine[q * nvec + v] = a;
        }
      }
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float mean_dot = dot / float(p.dim);
    // Registers: the row stays packed between the two passes. The empty asm makes the compiler
    // convert x and dy again below rather than keep fp32 copies of both (2x the registers:
    // 128 and spills at 8 vectors a lane in bf16, against 114 and none in fp16).
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      uint32_t* xr = reinterpret_cast<uint32_t*>(&xv[j]);
      uint32_t* gr = reinterpret_cast<uint32_t*>(&gv[j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(xr[i]), "+r"(gr[i]));
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int v = lane + 32 * j;
      if (v < nvec) {
        const NVec<T> wv = *reinterpret_cast<const NVec<T>*>(w + int64_t(v) * n);
        NVec<T> o;
#pragma unroll
        for (int e = 0; e < n; ++e) {
          const float nn = to_f(xv[j].v[e]) * rstd;
          o.v[e] = from_f<T>(rstd * (to_f(gv[j].v[e]) * to_f(wv.v[e]) - nn * mean_dot));
        }
        if (p.dres) {
          const NVec<T> d = *reinterpret_cast<const NVec<T>*>(static_cast<const T*>(p.dres) + row * p.dim + int64_t(v) * n);
#pragma unroll
          // __fadd_rn: never contracted with the product above into an FMA (in fp32, where
          // from_f is no rounding, nvcc did: not the unfused at::add's bits)
          for (int e = 0; e < n; ++e) o.v[e] = from_f<T>(__fadd_rn(to_f(o.v[e]), to_f(d.v[e])));
        }
        *reinterpret_cast<NVec<T>*>(dx + int64_t(v) * n) = o;
      }
    }
  }
  __syncthreads();
  // The block's partial row: column c = v * n + e summed over the warps in warp order.
  const float* flat = reinterpret_cast<const float*>(slices);
  const int per_warp = kQuads * nvec * 4;
  for (int s = threadIdx.x; s < per_warp; s += kThreads) {
    const int q = s / 4 / nvec, v = s / 4 % nvec, e = q * 4 + s % 4;
    float sum = 0.f;
    for (int k = 0; k < kWarpsB; ++k) sum += flat[k * per_warp + s];
    p.dw[int64_t(blockIdx.x) * p.dim + v * n + e] = sum;
  }
}

// The forward with a warp per row and the row in registers (16-byte loads, one read of x): the
// same formula as rms_norm_fwd, its sum of squares added in another order (a lane's elements,
// then the warp's lanes by shuffles). Rows are independent, so a row's bits do not depend on how
// many rows share the launch (the rollout engine's and the trainer's agree).
template <class T, int VPL>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd_warp(RmsNormParams p) {
  constexpr int n = NVec<T>::n, kWarpsB = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nvec = int(p.dim / n);
  const int64_t row = int64_t(blockIdx.x) * kWarpsB + warp;
  if (row >= p.rows) return;
  const T* x = static_cast<const T*>(p.x) + row * p.xs;
  T* y = static_cast<T*>(p.y) + row * p.dim;
  NVec<T> xv[VPL];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int v = lane + 32 * j;
    if (v < nvec) {
      xv[j] = *reinterpret_cast<const NVec<T>*>(x + int64_t(v) * n);
      if (p.r) {  // the residual sum, rounded as at::add rounds it, normalised and passed on
        const NVec<T> rv = *reinterpret_cast<const NVec<T>*>(static_cast<const T*>(p.r) + row * p.dim + int64_t(v) * n);
#pragma unroll
        for (int e = 0; e < n; ++e) xv[j].v[e] = from_f<T>(to_f(xv[j].v[e]) + to_f(rv.v[e]));
        *reinterpret_cast<NVec<T>*>(static_cast<T*>(p.s) + row * p.dim + int64_t(v) * n) = xv[j];
      }
#pragma unroll
      for (int e = 0; e < n; ++e) {
        const float f = to_f(xv[j].v[e]);
        ss += f * f;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float rstd = rsqrtf(ss / float(p.dim) + p.eps);
  if (lane == 0) p.rstd[row] = rstd;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int v = lane + 32 * j;
    if (v < nvec) {
      const NVec<T> wv = *reinterpret_cast<const NVec<T>*>(static_cast<const T*>(p.w) + int64_t(v) * n);
      NVec<T> o;
#pragma unroll
      for (int e = 0; e < n; ++e) {
        const T normed = from_f<T>(to_f(xv[j].v[e]) * rstd);  // rounded to x's dtype before the weight
        o.v[e] = from_f<T>(to_f(wv.v[e]) * to_f(normed));
      }
      *reinterpret_cast<NVec<T>*>(y + int64_t(v) * n) = o;
    }
  }
}

// Vectors a lane for the warp kernels (rows of at most 8 a lane, every tensor on a 16-byte
// boundary), 0 when the row takes the block kernels.
int64_t warp_vectors_per_lane(std::initializer_list<const at::Tensor*> ts, int64_t D) {
  const int64_t elem = int64_t(ts.begin()[0]->element_size());
  if ((D * elem) % 16 != 0) return 0;
  for (const auto* t : ts)
    if (reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 != 0) return 0;
  const int64_t vpl = (D * elem / 16 + 31) / 32;
  return vpl >= 1 && vpl <= 8 ? vpl : 0;
}

// x's row stride for the warp kernels: rows of unit column stride that each start on a 16-byte
// boundary (kernels/alignment.hpp), else 0 (the caller copies x). A contiguous x: D (its start is
// checked by warp_vectors_per_lane, which sends a misaligned one to the block kernel).
int64_t warp_row_stride(const at::Tensor& x) {
  if (x.is_contiguous() || (x.size(0) <= 1 && rows_aligned16(x))) return x.size(1);
  return rows_aligned16(x) ? x.stride(0) : 0;
}

// Calls f(integral_constant<int, VPL>) with VPL the next size the warp kernels are built for.
template <class F>
void with_vpl(int64_t vpl, F f) {
  switch (vpl) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;  // 5..8: the masked lanes skip
  }
}

}  // namespace

void rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd,
                      const at::Tensor* r, at::Tensor* s) {
  const c10::cuda::CUDAGuard guard(x.device());  // launch on the tensors' GPU, not the current one
  if (x.size(0) == 0) return;
  const int64_t xs = warp_row_stride(x);
  const bool warp = xs != 0 && (r ? warp_vectors_per_lane({&x, &w, &y, r, s}, x.size(1)) != 0
                                  : warp_vectors_per_lane({&x, &w, &y}, x.size(1)) != 0);
  if (!warp && !x.is_contiguous()) {  // strided rows: the warp kernels only
    rms_norm_forward(x.contiguous(), w, eps, y, rstd, r, s);
    return;
  }
  if (r && !warp) {  // the block kernel has no residual form: the sum by at::add, then the norm
    at::add_out(*s, x, *r);
    rms_norm_forward(*s, w, eps, y, rstd);
    return;
  }
  RmsNormParams p{x.data_ptr(), w.data_ptr(), nullptr, y.data_ptr(), rstd.data_ptr<float>(), nullptr,
                  x.size(0), x.size(1), float(eps)};
  p.xs = warp ? xs : x.size(1);
  if (r) {
    p.r = r->data_ptr();
    p.s = s->data_ptr();
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  if (const int64_t vpl = warp ? warp_vectors_per_lane({&x, &w, &y}, p.dim) : 0) {
    const int64_t blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
    dispatch_floating(x.scalar_type(), "rms_norm", [&](auto tag) {
      with_vpl(vpl, [&](auto vc) {
        rms_norm_fwd_warp<decltype(tag), decltype(vc)::value><<<unsigned(blocks), kThreads, 0, stream>>>(p);
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  dispatch_floating(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_fwd<decltype(tag)><<<unsigned(p.rows), kThreads, 0, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                       at::Tensor& dx, at::Tensor& dw_fp32, const at::Tensor* dres) {
  const c10::cuda::CUDAGuard guard(x.device());  // launch on the tensors' GPU, not the current one
  if (x.size(0) == 0) return;
  const int64_t xs = warp_row_stride(x);
  // The warp kernel's dw slices: D floats a warp (at most 8 KB), 64 KB a block at D 2048 bf16
  // (opted in; a GPU that cannot give a block that much takes the block kernel).
  const size_t warp_smem = size_t(kThreads / 32) * size_t(x.size(1)) * sizeof(float);
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const bool warp_smem_ok = warp_smem <= props->sharedMemPerBlockOptin;
  if (!x.is_contiguous() && (xs == 0 || !warp_smem_ok || !warp_vectors_per_lane({&x, &dy, &w, &dx}, x.size(1)))) {
    rms_norm_backward(dy, x.contiguous(), w, rstd, dx, dw_fp32, dres);  // strided rows: the warp kernel only
    return;
  }
  if (dres && (!warp_smem_ok || !warp_vectors_per_lane({&x, &dy, &w, &dx, dres}, x.size(1)))) {  // block kernel, sum
    rms_norm_backward(dy, x, w, rstd, dx, dw_fp32);
    dx.add_(*dres);
    return;
  }
  const int sms = props->multiProcessorCount;
  auto stream = at::cuda::getCurrentCUDAStream();
  // The warp-per-row kernel: rows of at most 8 vectors a lane, every tensor on a 16-byte boundary.
  const int64_t D = x.size(1);
  if (const int64_t vpl = warp_smem_ok ? warp_vectors_per_lane({&x, &dy, &w, &dx}, D) : 0) {
    const size_t smem = warp_smem;
    const int64_t blocks = std::min<int64_t>((x.size(0) + kThreads / 32 - 1) / (kThreads / 32), 2 * int64_t(sms));
    auto partial = at::empty({blocks, D}, x.options().dtype(at::kFloat));  // [blocks, D]
    RmsNormParams p{x.data_ptr(), w.data_ptr(), dy.data_ptr(), dx.data_ptr(), rstd.data_ptr<float>(),
                    partial.data_ptr<float>(), x.size(0), D, 0.f};
    p.xs = xs;
    if (dres) p.dres = dres->data_ptr();
    dispatch_floating(x.scalar_type(), "rms_norm", [&](auto tag) {
      with_vpl(vpl, [&](auto vc) {
        auto* kernel = rms_norm_bwd_warp<decltype(tag), decltype(vc)::value>;
        static SmemOptIn opt_in;  // one per kernel instance, raised to the largest D seen
        opt_in.raise(kernel, smem, x.get_device());
        kernel<<<unsigned(blocks), kThreads, smem, stream>>>(p);
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::sum_out(dw_fp32, partial, {0});
    return;
  }
  const size_t smem = size_t(x.size(1)) * sizeof(float);
  TORCH_CHECK(smem <= 48 * 1024, "rms_norm backward: D = ", x.size(1), " over the kernel's limit of 12288");
  const int64_t blocks = std::min<int64_t>(x.size(0), 4 * int64_t(sms));
  auto partial = at::empty({blocks, x.size(1)}, x.options().dtype(at::kFloat));  // [blocks, D]
  RmsNormParams p{x.data_ptr(), w.data_ptr(), dy.data_ptr(), dx.data_ptr(), rstd.data_ptr<float>(),
                  partial.data_ptr<float>(), x.size(0), x.size(1), 0.f};
  p.xs = x.size(1);
  dispatch_floating(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_bwd<decltype(tag)><<<unsigned(blocks), kThreads, smem, stream>>>(p);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::sum_out(dw_fp32, partial, {0});
}

}  // namespace kiln::kernels::cuda
