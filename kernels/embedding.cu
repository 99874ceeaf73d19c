// The embedding's weight gradient (kernels/embedding.hpp): ids sorted with their positions,
// whole 32-entry chunks of one id summed, then every row of the [V, D] gradient written once by
// a warp (its tokens' dy rows summed in fp32, or zeros).
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/dtype_dispatch.cuh"
#include "kernels/embedding_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kChunk = 32;       // sorted entries summed by one warp of chunk_sums
constexpr int kDirectMax = 2 * kChunk;  // a row's run at most this long is summed row by row

template <class T>
struct alignas(16) Vec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

// First index i in [0, T) with key[i] >= v (T if none).
__device__ __forceinline__ int lower_bound(const int32_t* key, int T, int32_t v) {
  int lo = 0, hi = T;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (key[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// acc += dy row `row`'s vector at column c (a lane's n elements).
template <class T>
__device__ __forceinline__ void add_row(float* acc, const T* dy, int64_t D, int32_t row, int64_t c) {
  const Vec<T> x = *reinterpret_cast<const Vec<T>*>(dy + int64_t(row) * D + c);
#pragma unroll
  for (int e = 0; e < Vec<T>::n; ++e) acc[e] += to_f(x.v[e]);
}

// partial [n_chunks, D] fp32: chunk c (sorted entries [32c, 32c + 32), all of one id) summed in
// order; chunks that are not whole or hold two ids are skipped (their rows are never read).
// A warp per (chunk, 32 vectors of columns).
template <class T>
__global__ void __launch_bounds__(kThreads) chunk_sums(const T* __restrict__ dy, const int32_t* __restrict__ key,
                                                       const int32_t* __restrict__ pos, float* __restrict__ partial,
                                                       int T_, int64_t D, int n_chunks) {
  constexpr int n = Vec<T>::n;
  const int lane = threadIdx.x % 32;
  const int chunk = int(blockIdx.x) * kWarps + int(threadIdx.x / 32);
  if (chunk >= n_chunks) return;
  const int s = chunk * kChunk;
  if (s + kChunk > T_ || key[s] != key[s + kChunk - 1]) return;
  const int64_t c = (int64_t(blockIdx.y) * 32 + lane) * n;
  if (c >= D) return;
  float acc[n] = {};
  for (int i = s; i < s + kChunk; ++i) add_row(acc, dy, D, pos[i], c);
#pragma unroll
  for (int e = 0; e < n; ++e) partial[int64_t(chunk) * D + c + e] = acc[e];
}

// dw [V, D]: a warp per row v, 32 vectors of columns at a time, sums the dy rows of the sorted
// entries [lo, hi) with key v: row by row when the run is at most kDirectMax, else its rows
// before the first whole chunk, the whole chunks' partials, then its rows after them, in that
// order; a row no token has is written with zeros.
template <class T>
__global__ void __launch_bounds__(kThreads) rows_kernel(const T* __restrict__ dy, const int32_t* __restrict__ key,
                                                        const int32_t* __restrict__ pos,
                                                        const float* __restrict__ partial, T* __restrict__ dw,
                                                        int T_, int64_t V, int64_t D) {
  constexpr int n = Vec<T>::n;
  const int lane = threadIdx.x % 32;
  const int64_t v = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (v >= V) return;
  const int lo = lower_bound(key, T_, int32_t(v));
  const int hi = lo < T_ && key[lo] == int32_t(v) ? lower_bound(key, T_, int32_t(v) + 1) : lo;
  const int c0 = (lo + kChunk - 1) / kChunk, c1 = hi / kChunk;  // whole chunks [c0, c1) (long runs)
  for (int64_t c = int64_t(lane) * n; c < D; c += 32 * n) {
    float acc[n] = {};
    if (hi - lo <= kDirectMax) {
      for (int i = lo; i < hi; ++i) add_row(acc, dy, D, pos[i], c);
    } else {
      for (int i = lo; i < c0 * kChunk; ++i) add_row(acc, dy, D, pos[i], c);
      for (int ch = c0; ch < c1; ++ch) {
        const float* p = partial + int64_t(ch) * D + c;
#pragma unroll
        for (int e = 0; e < n; ++e) acc[e] += p[e];
      }
      for (int i = c1 * kChunk; i < hi; ++i) add_row(acc, dy, D, pos[i], c);
    }
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < n; ++e) o.v[e] = from_f<T>(acc[e]);
    *reinterpret_cast<Vec<T>*>(dw + v * D + c) = o;
  }
}

}  // namespace

void embedding_backward(const at::Tensor& dy, const at::Tensor& ids, at::Tensor& dw) {
  const c10::cuda::CUDAGuard guard(dy.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int T_ = int(ids.numel());
  const int64_t V = dw.size(0), D = dw.size(1);
  if (T_ == 0) {
    dw.zero_();
    return;
  }
  auto i32 = ids.options().dtype(at::kInt);
  auto key_in = ids.to(at::kInt), key = at::empty({T_}, i32), pos = at::empty({T_}, i32);
  auto pos_in = at::arange(T_, i32);
  // All 32 bits (signed order): an id outside [0, V) sorts where it belongs and matches no row.
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, key_in.data_ptr<int32_t>(),
                                                 key.data_ptr<int32_t>(), pos_in.data_ptr<int32_t>(),
                                                 pos.data_ptr<int32_t>(), T_, 0, 32, stream));
  auto temp = at::empty({int64_t(temp_bytes) + 1}, ids.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, key_in.data_ptr<int32_t>(),
                                                 key.data_ptr<int32_t>(), pos_in.data_ptr<int32_t>(),
                                                 pos.data_ptr<int32_t>(), T_, 0, 32, stream));
  const int n_chunks = T_ / kChunk;
  dispatch_floating(dy.scalar_type(), "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Vec<T>::n;
    const unsigned col_blocks = unsigned((D / n + 31) / 32);
    auto partial = at::empty({std::max(n_chunks, 1), D}, dy.options().dtype(at::kFloat));
    if (n_chunks > 0) {
      chunk_sums<T><<<dim3(unsigned((n_chunks + kWarps - 1) / kWarps), col_blocks), kThreads, 0, stream>>>(
          static_cast<const T*>(dy.data_ptr()), key.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
          partial.data_ptr<float>(), T_, D, n_chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    rows_kernel<T><<<unsigned((V + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        static_cast<const T*>(dy.data_ptr()), key.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
        partial.data_ptr<float>(), static_cast<T*>(dw.data_ptr()), T_, V, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace kiln::kernels::cuda
