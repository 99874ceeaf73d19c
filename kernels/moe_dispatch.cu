// MoE dispatch order and combine (kernels/moe_dispatch.hpp).
//
// dispatch_order: one CTA of 1024 threads; warp w owns slots 32w..32w+31 (M <= 1024). Each lane
// finds the lanes of its warp with the same expert (__match_any_sync), its rank among the lower
// ones, and the lowest of them records the warp's count for that expert in table[w][e]; a thread
// per expert turns its column into offsets over the warps (in warp order), an exclusive scan
// over experts gives each expert's first row, and row = first[e] + table[w][e] + rank: rows in
// expert order, ties in slot order, as a stable sort gives.
// combine: one CTA per token, threads over the hidden dim, the K rows' fp32 products summed in
// k order and rounded once. combine_backward: one CTA per token, for each k the row's gradient
// written (weight * grad_y, rounded once) while each thread sums its part of the dot product
// rows . grad_y; the parts are summed per warp (shuffles) and the warps' in warp order.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/dtype.cuh"
#include "kernels/moe_dispatch_cuda.hpp"
#include "kernels/smem_opt_in.cuh"

namespace kiln::kernels::cuda {

namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
static_assert(kDispatchMaxSlots == kThreads && kDispatchMaxExperts <= kThreads, "one slot and one expert a thread");

// Dynamic shared memory, (kWarps + 2) * E ints: table [kWarps][E], first [E], total [E].
__global__ void __launch_bounds__(kThreads) dispatch_order_kernel(const int64_t* __restrict__ ids, int M, int K,
                                                                   int E, int64_t* __restrict__ slot,
                                                                   int64_t* __restrict__ token_index,
                                                                   int64_t* __restrict__ row_of_slot,
                                                                   int64_t* __restrict__ counts) {
  extern __shared__ int smem[];
  int* table = smem;              // [kWarps][E]
  int* first = smem + kWarps * E;  // [E]
  int* total = first + E;          // [E]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kWarps * E; i += kThreads) table[i] = 0;
  __syncthreads();
  const bool valid = tid < M;
  int e = -1 - lane;  // distinct per idle lane: matches no other lane
  if (valid) {
    const int64_t v = ids[tid];
    e = int(v < 0 ? 0 : (v >= E ? E - 1 : v));
  }
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank = __popc(peers & ((1u << lane) - 1u));
  if (valid && rank == 0) table[warp * E + e] = __popc(peers);
  __syncthreads();
  if (tid < E) {  // column e: counts of the warps -> offsets within the expert, in warp order
    int run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int c = table[w * E + tid];
      table[w * E + tid] = run;
      run += c;
    }
    first[tid] = run;  // scanned below
    total[tid] = run;
    counts[tid] = run;
  }
  __syncthreads();
  // Exclusive scan of the totals over experts (Hillis-Steele, in place through a register).
  for (int step = 1; step < E; step <<= 1) {
    int add = 0;
    if (tid < E && tid >= step) add = first[tid - step];
    __syncthreads();
    if (tid < E) first[tid] += add;
    __syncthreads();
  }
  if (valid) {
    const int row = (first[e] - total[e]) + table[warp * E + e] + rank;  // inclusive scan -> the expert's start
    slot[row] = tid;
    token_index[row] = tid / K;
    row_of_slot[tid] = row;
  }
}

template <typename T>
__global__ void combine_kernel(const T* __restrict__ rows, const int64_t* __restrict__ row_of_slot,
                               const float* __restrict__ weights, T* __restrict__ out, int K, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
      const int64_t r = row_of_slot[t * K + k];
      acc = __fadd_rn(acc, __fmul_rn(to_f(rows[r * D + d]), weights[t * K + k]));
    }
    out[t * D + d] = from_f<T>(acc);
  }
}

constexpr int kCombineThreads = 256;

// The vector forms: 16 bytes a load and a store, K a template constant so that a token's K row
// loads are all in flight before the first is used (one 2-byte load at a time ran the combine
// at ~1.6 TB/s on the H200). Per element the same arithmetic as the scalar kernels above.
template <class T>
struct alignas(16) CVec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

template <typename T, int K>
__global__ void __launch_bounds__(kCombineThreads)
    combine_vec_kernel(const T* __restrict__ rows, const int64_t* __restrict__ row_of_slot,
                       const float* __restrict__ weights, T* __restrict__ out, int64_t D) {
  constexpr int n = CVec<T>::n;
  const int64_t t = blockIdx.x;
  int64_t r[K];
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    r[k] = row_of_slot[t * K + k];
    w[k] = weights[t * K + k];
  }
  for (int64_t d = int64_t(threadIdx.x) * n; d < D; d += int64_t(kCombineThreads) * n) {
    CVec<T> x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = *reinterpret_cast<const CVec<T>*>(rows + r[k] * D + d);
    CVec<T> o;
#pragma unroll
    for (int e = 0; e < n; ++e) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) acc = __fadd_rn(acc, __fmul_rn(to_f(x[k].v[e]), w[k]));
      o.v[e] = from_f<T>(acc);
    }
    *reinterpret_cast<CVec<T>*>(out + t * D + d) = o;
  }
}

// combine_backward with 16-byte vectors: each thread's dot-product part sums its elements in
// d order (so the weights' gradients round as the scalar kernel's do only up to that order).
template <typename T, int K>
__global__ void __launch_bounds__(kCombineThreads)
    combine_backward_vec_kernel(const T* __restrict__ rows, const int64_t* __restrict__ row_of_slot,
                                const float* __restrict__ weights, const T* __restrict__ grad,
                                T* __restrict__ grad_rows, float* __restrict__ grad_weights, int64_t D) {
  constexpr int n = CVec<T>::n, kWarpsC = kCombineThreads / 32;
  __shared__ float part[kWarpsC][K];
  const int64_t t = blockIdx.x;
  int64_t r[K];
  float w[K], dot[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    r[k] = row_of_slot[t * K + k];
    w[k] = weights[t * K + k];
    dot[k] = 0.f;
  }
  for (int64_t d = int64_t(threadIdx.x) * n; d < D; d += int64_t(kCombineThreads) * n) {
    const CVec<T> g = *reinterpret_cast<const CVec<T>*>(grad + t * D + d);
    CVec<T> x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] = *reinterpret_cast<const CVec<T>*>(rows + r[k] * D + d);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      CVec<T> gx;
#pragma unroll
      for (int e = 0; e < n; ++e) {
        const float gd = to_f(g.v[e]);
        gx.v[e] = from_f<T>(__fmul_rn(gd, w[k]));
        dot[k] = __fmaf_rn(to_f(x[k].v[e]), gd, dot[k]);
      }
      *reinterpret_cast<CVec<T>*>(grad_rows + r[k] * D + d) = gx;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float v = dot[k];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < K) {
    float sum = part[0][threadIdx.x];
    for (int i = 1; i < kWarpsC; ++i) sum += part[i][threadIdx.x];
    grad_weights[t * K + threadIdx.x] = sum;
  }
}

// Calls f(std::integral_constant<int, K>) for K in 1..8, else returns false.
template <class F>
bool with_top_k(int K, F f) {
  switch (K) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// Rows and outputs the vector kernels can read and write: D a multiple of the vector, every
// tensor's data on a 16-byte boundary.
bool vector_ready(std::initializer_list<const at::Tensor*> ts, int64_t D, int64_t elem) {
  if ((D * elem) % 16 != 0) return false;
  for (const auto* t : ts)
    if (reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_backward_kernel(const T* __restrict__ rows, const int64_t* __restrict__ row_of_slot,
                            const float* __restrict__ weights, const T* __restrict__ grad, T* __restrict__ grad_rows,
                            float* __restrict__ grad_weights, int K, int64_t D) {
  constexpr int kWarpsC = kCombineThreads / 32;
  __shared__ float part[kWarpsC];
  const int64_t t = blockIdx.x;
  const T* g = grad + t * D;
  for (int k = 0; k < K; ++k) {
    const int64_t r = row_of_slot[t * K + k];
    const float w = weights[t * K + k];
    const T* x = rows + r * D;
    T* gx = grad_rows + r * D;
    float dot = 0.f;
    for (int64_t d = threadIdx.x; d < D; d += kCombineThreads) {
      const float gd = to_f(g[d]);
      gx[d] = from_f<T>(__fmul_rn(gd, w));
      dot = __fmaf_rn(to_f(x[d]), gd, dot);
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = part[0];
      for (int i = 1; i < kWarpsC; ++i) sum += part[i];
      grad_weights[t * K + k] = sum;
    }
    __syncthreads();  // part is rewritten by the next k
  }
}

}  // namespace

void dispatch_order(const at::Tensor& ids, int64_t num_experts, at::Tensor& slot, at::Tensor& token_index,
                    at::Tensor& row_of_slot, at::Tensor& counts) {
  const c10::cuda::CUDAGuard guard(ids.device());
  const int M = int(ids.numel()), K = int(ids.size(1)), E = int(num_experts);
  TORCH_CHECK(M >= 1 && M <= kDispatchMaxSlots && E >= 1 && E <= kDispatchMaxExperts, "dispatch_order: kernel for ",
              "1..", kDispatchMaxSlots, " slots and 1..", kDispatchMaxExperts, " experts, got ", M, " and ", E);
  const std::size_t smem = sizeof(int) * std::size_t((kWarps + 2) * E);
  // Past 48 KB (E > 353) the kernel must opt in: for the largest E, once per device.
  static SmemOptIn opt_in;
  opt_in.raise(dispatch_order_kernel, sizeof(int) * std::size_t((kWarps + 2) * kDispatchMaxExperts), ids.get_device());
  dispatch_order_kernel<<<1, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      ids.data_ptr<int64_t>(), M, K, E, slot.data_ptr<int64_t>(), token_index.data_ptr<int64_t>(),
      row_of_slot.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moe_combine(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& weights, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t T = weights.size(0), D = rows.size(1);
  const int K = int(weights.size(1));
  const int threads = D >= 256 ? 256 : 64;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto vec = [&](auto tag) {
    using T_ = decltype(tag);
    return vector_ready({&rows, &out}, D, int64_t(sizeof(T_))) && with_top_k(K, [&](auto kc) {
             combine_vec_kernel<T_, decltype(kc)::value><<<unsigned(T), kCombineThreads, 0, stream>>>(
                 static_cast<const T_*>(rows.data_ptr()), row_of_slot.data_ptr<int64_t>(), weights.data_ptr<float>(),
                 static_cast<T_*>(out.data_ptr()), D);
           });
  };
  const auto dt = rows.scalar_type();
  if ((dt == at::kFloat && vec(float{})) || (dt == at::kBFloat16 && vec(__nv_bfloat16{})) ||
      (dt == at::kHalf && vec(__half{}))) {
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  switch (rows.scalar_type()) {
    case at::kFloat:
      combine_kernel<float><<<unsigned(T), threads, 0, stream>>>(rows.data_ptr<float>(), row_of_slot.data_ptr<int64_t>(),
                                                                  weights.data_ptr<float>(), out.data_ptr<float>(), K, D);
      break;
    case at::kBFloat16:
      combine_kernel<__nv_bfloat16><<<unsigned(T), threads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(rows.data_ptr()), row_of_slot.data_ptr<int64_t>(),
          weights.data_ptr<float>(), static_cast<__nv_bfloat16*>(out.data_ptr()), K, D);
      break;
    case at::kHalf:
      combine_kernel<__half><<<unsigned(T), threads, 0, stream>>>(static_cast<const __half*>(rows.data_ptr()),
                                                                   row_of_slot.data_ptr<int64_t>(),
                                                                   weights.data_ptr<float>(),
                                                                   static_cast<__half*>(out.data_ptr()), K, D);
      break;
    default: TORCH_CHECK(false, "moe_combine: no kernel for dtype ", rows.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moe_combine_backward(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& weights,
                          const at::Tensor& grad, at::Tensor& grad_rows, at::Tensor& grad_weights) {
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t T = weights.size(0), D = rows.size(1);
  const int K = int(weights.size(1));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto tag) {
    using T_ = decltype(tag);
    if (vector_ready({&rows, &grad, &grad_rows}, D, int64_t(sizeof(T_))) && with_top_k(K, [&](auto kc) {
          combine_backward_vec_kernel<T_, decltype(kc)::value><<<unsigned(T), kCombineThreads, 0, stream>>>(
              static_cast<const T_*>(rows.data_ptr()), row_of_slot.data_ptr<int64_t>(), weights.data_ptr<float>(),
              static_cast<const T_*>(grad.data_ptr()), static_cast<T_*>(grad_rows.data_ptr()),
              grad_weights.data_ptr<float>(), D);
        }))
      return;
    combine_backward_kernel<T_><<<unsigned(T), kCombineThreads, 0, stream>>>(
        static_cast<const T_*>(rows.data_ptr()), row_of_slot.data_ptr<int64_t>(), weights.data_ptr<float>(),
        static_cast<const T_*>(grad.data_ptr()), static_cast<T_*>(grad_rows.data_ptr()),
        grad_weights.data_ptr<float>(), K, D);
  };
  switch (rows.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kBFloat16: launch(__nv_bfloat16{}); break;
    case at::kHalf: launch(__half{}); break;
    default: TORCH_CHECK(false, "moe_combine_backward: no kernel for dtype ", rows.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
