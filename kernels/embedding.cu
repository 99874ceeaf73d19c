// The embedding's weight gradient (kernels/embedding.hpp): one warp per vocabulary row, 16-byte
// loads and stores, the row's tokens summed in fp32 in the given (token) order.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/dtype.cuh"
#include "kernels/embedding_cuda.hpp"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256, kWarps = kThreads / 32;

template <class T>
struct alignas(16) Vec {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

// Row v of out: sum over k in [offsets[v], offsets[v+1]) of grad[order[k]], each 16-byte column
// group by one lane (a loop when D needs more than 32 of them).
template <class T>
__global__ void __launch_bounds__(kThreads) embedding_backward_kernel(const T* __restrict__ grad,
                                                                      const int64_t* __restrict__ order,
                                                                      const int64_t* __restrict__ offsets,
                                                                      T* __restrict__ out, int64_t V, int64_t D) {
  constexpr int n = Vec<T>::n;
  const int lane = threadIdx.x % 32;
  const int64_t groups = D / n;
  for (int64_t v = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; v < V; v += int64_t(gridDim.x) * kWarps) {
    const int64_t lo = offsets[v], hi = offsets[v + 1];
    Vec<T>* row = reinterpret_cast<Vec<T>*>(out + v * D);
    for (int64_t c = lane; c < groups; c += 32) {
      float acc[n];
#pragma unroll
      for (int j = 0; j < n; ++j) acc[j] = 0.f;
      for (int64_t k = lo; k < hi; ++k) {
        const Vec<T> g = reinterpret_cast<const Vec<T>*>(grad + order[k] * D)[c];
#pragma unroll
        for (int j = 0; j < n; ++j) acc[j] += to_f(g.v[j]);
      }
      Vec<T> o;
#pragma unroll
      for (int j = 0; j < n; ++j) o.v[j] = from_f<T>(acc[j]);
      row[c] = o;
    }
  }
}

template <class F>
void dispatch(at::ScalarType t, F f) {
  if (t == at::kBFloat16) f(__nv_bfloat16{});
  else if (t == at::kHalf) f(__half{});
  else if (t == at::kFloat) f(float{});
  else TORCH_CHECK(false, "embedding_backward kernel: dtype ", t, " not supported (fp32, bf16, fp16)");
}
}  // namespace

void embedding_backward(const at::Tensor& grad, const at::Tensor& order, const at::Tensor& offsets, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t V = out.size(0), D = out.size(1);
  if (V == 0 || D == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = (V + kWarps - 1) / kWarps;
  const unsigned grid = unsigned(blocks < 65535 * 16 ? blocks : 65535 * 16);  // grid-stride beyond
  dispatch(grad.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    embedding_backward_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(grad.data_ptr()), order.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
        static_cast<T*>(out.data_ptr()), V, D);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
