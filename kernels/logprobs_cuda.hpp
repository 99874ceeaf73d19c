#pragma once
// Host entry points of kernels/logprobs.cu (CUDA builds only). All tensors contiguous.
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
void logprob_forward(const at::Tensor& z, const at::Tensor& targets, at::Tensor& logp, at::Tensor& lse,
                     at::Tensor* entropy, at::Tensor* mean_z);
void logprob_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& g_lp,
                      const at::Tensor* g_ent, const at::Tensor* mean_z, at::Tensor& dz);
}  // namespace kiln::kernels::cuda
