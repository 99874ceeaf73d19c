// AdamW over fp32 masters from 16-bit gradients, the masters rounded into the 16-bit parameters
// in the same pass (kernels/adamw.hpp). One launch for every parameter: block b takes chunk c of
// parameter s, found by a binary search over the parameters' first chunks in a table uploaded
// with the launch; a thread updates 4 elements at a time (16-byte fp32 and 8-byte 16-bit loads and
// stores) where all five operands of the parameter start on those boundaries, else one.
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "kernels/adamw_cuda.hpp"
#include "kernels/dtype.cuh"

namespace kiln::kernels::cuda {

namespace {
constexpr int kThreads = 256, kVec = 4;
constexpr int64_t kChunk = 65536;  // elements of one parameter per block (torch's multi-tensor chunk)

// One parameter's operands, as the table holds them.
struct Slot {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param;
  const float* step;
  int64_t numel;
  int64_t first_chunk;  // chunks of the parameters before this one
  int64_t vector_ok;    // 1: every operand starts on its 4-element boundary
};

struct Hyper {
  float lr, beta1, beta2, weight_decay, eps;
};

template <class T>
struct alignas(sizeof(T) * kVec) Vec4 {
  T v[kVec];
};

// torch's adam_math (fused_adam_utils.cuh, ADAMW, fp32 opmath), one element, written in the same
// order so that the compiler contracts it the same way.
__device__ __forceinline__ void adamw_element(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                              const Hyper& h, float bias_correction1, float bias_correction2_sqrt) {
  if (h.weight_decay != 0) param -= h.lr * h.weight_decay * param;
  exp_avg = fmaf(h.beta1, exp_avg, fmaf(-h.beta1, grad, grad));
  exp_avg_sq = fmaf(h.beta2, exp_avg_sq, fmaf(-h.beta2, grad * grad, grad * grad));
  const float step_size = h.lr / bias_correction1;
  const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + h.eps;
  param -= step_size * exp_avg / denom;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const Slot* __restrict__ slots, int n, const float* __restrict__ grad_scale, Hyper h) {
  __shared__ int slot_index;
  if (threadIdx.x == 0) {  // the last parameter whose first chunk is at or before this block
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (slots[mid].first_chunk <= int64_t(blockIdx.x)) lo = mid;
      else hi = mid - 1;
    }
    slot_index = lo;
  }
  __syncthreads();
  const Slot s = slots[slot_index];
  const int64_t begin = (int64_t(blockIdx.x) - s.first_chunk) * kChunk;
  const int64_t end = begin + kChunk < s.numel ? begin + kChunk : s.numel;
  const float scale = *grad_scale;
  // The bias corrections as torch's functor computes them from the fp32 step count.
  const float step = *s.step;
  const float bias_correction1 = 1 - powf(h.beta1, step);
  const float bias_correction2_sqrt = sqrtf(1 - powf(h.beta2, step));
  const T* grad = static_cast<const T*>(s.grad);
  T* param = static_cast<T*>(s.param);
  int64_t scalar_from = begin;
  if (s.vector_ok) {
    const int64_t vec_end = begin + (end - begin) / kVec * kVec;
    for (int64_t i = begin + int64_t(threadIdx.x) * kVec; i < vec_end; i += int64_t(kThreads) * kVec) {
      float4 p = *reinterpret_cast<const float4*>(s.master + i);
      float4 m = *reinterpret_cast<const float4*>(s.exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(s.exp_avg_sq + i);
      const Vec4<T> g = *reinterpret_cast<const Vec4<T>*>(grad + i);
      adamw_element(p.x, to_f(g.v[0]) * scale, m.x, v.x, h, bias_correction1, bias_correction2_sqrt);
      adamw_element(p.y, to_f(g.v[1]) * scale, m.y, v.y, h, bias_correction1, bias_correction2_sqrt);
      adamw_element(p.z, to_f(g.v[2]) * scale, m.z, v.z, h, bias_correction1, bias_correction2_sqrt);
      adamw_element(p.w, to_f(g.v[3]) * scale, m.w, v.w, h, bias_correction1, bias_correction2_sqrt);
      *reinterpret_cast<float4*>(s.master + i) = p;
      *reinterpret_cast<float4*>(s.exp_avg + i) = m;
      *reinterpret_cast<float4*>(s.exp_avg_sq + i) = v;
      Vec4<T> out;
      out.v[0] = from_f<T>(p.x);
      out.v[1] = from_f<T>(p.y);
      out.v[2] = from_f<T>(p.z);
      out.v[3] = from_f<T>(p.w);
      *reinterpret_cast<Vec4<T>*>(param + i) = out;
    }
    scalar_from = vec_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads) {
    float p = s.master[i], m = s.exp_avg[i], v = s.exp_avg_sq[i];
    adamw_element(p, to_f(grad[i]) * scale, m, v, h, bias_correction1, bias_correction2_sqrt);
    s.master[i] = p;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    param[i] = from_f<T>(p);
  }
}

bool on_boundary(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }
}  // namespace

void adamw_step_low_precision(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                              const std::vector<at::Tensor>& steps, float lr, float beta1, float beta2,
                              float weight_decay, float eps) {
  std::vector<Slot> table;
  int64_t chunks = 0;
  const std::size_t elem16 = grads.empty() ? 2 : grads.front().element_size();
  for (std::size_t i = 0; i < masters.size(); ++i) {
    const int64_t numel = masters[i].numel();
    if (numel == 0) continue;
    Slot s{masters[i].data_ptr<float>(), exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
           grads[i].data_ptr(), params[i].data_ptr(), steps[i].data_ptr<float>(), numel, chunks, 0};
    s.vector_ok = on_boundary(s.master, 16) && on_boundary(s.exp_avg, 16) && on_boundary(s.exp_avg_sq, 16) &&
                  on_boundary(s.grad, kVec * elem16) && on_boundary(s.param, kVec * elem16);
    table.push_back(s);
    chunks += (numel + kChunk - 1) / kChunk;
  }
  if (table.empty()) return;
  TORCH_CHECK(chunks <= int64_t(INT32_MAX), "adamw_step_low_precision: ", chunks, " chunks exceed one launch's grid");
  const c10::cuda::CUDAGuard guard(masters.front().device());
  auto stream = at::cuda::getCurrentCUDAStream();
  // The table through pinned memory: the caching host allocator keeps the block until the copy is done.
  const int64_t bytes = int64_t(table.size() * sizeof(Slot));
  auto host = at::empty({bytes}, at::TensorOptions(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), std::size_t(bytes));
  const auto dev = host.to(masters.front().device(), /*non_blocking=*/true);
  const Hyper h{lr, beta1, beta2, weight_decay, eps};
  const auto* slots = reinterpret_cast<const Slot*>(dev.data_ptr());
  const int n = int(table.size());
  const float* scale = grad_scale.data_ptr<float>();
  if (grads.front().scalar_type() == at::kBFloat16)
    adamw_kernel<__nv_bfloat16><<<unsigned(chunks), kThreads, 0, stream>>>(slots, n, scale, h);
  else
    adamw_kernel<__half><<<unsigned(chunks), kThreads, 0, stream>>>(slots, n, scale, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kiln::kernels::cuda
