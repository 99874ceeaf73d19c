#pragma once
// Host entry point of kernels/sampling.cu (CUDA builds only). All tensors contiguous, on one
// device, of kernels/sampling.hpp's shapes and dtypes; out [B, 3] fp64 is written.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/sampling.hpp"

namespace kiln::kernels::cuda {
/// kernels::kSampleKernelMaxVocab: cuda::sample_rows throws past it.
constexpr int64_t kMaxVocab = kSampleKernelMaxVocab;

void sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                 const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& step, at::Tensor& out);
}  // namespace kiln::kernels::cuda
