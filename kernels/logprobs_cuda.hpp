#pragma once
// Host entry points of kernels/logprobs.cu (CUDA builds only). All tensors contiguous.
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// z: fp32 or the 16-bit model_dtype; keep (optional, model_dtype [n, V]) gets z rounded,
/// keep_lse / keep_mean_z (with keep; the latter optional) the stats of the rounded values.
void logprob_forward(const at::Tensor& z, const at::Tensor& targets, at::Tensor& logp, at::Tensor& lse,
                     at::Tensor* entropy, at::Tensor* mean_z, at::Tensor* keep, at::Tensor* keep_lse,
                     at::Tensor* keep_mean_z, at::ScalarType model_dtype);
/// dz: the 16-bit output (its dtype picks the kernel); z: fp32 or dz's dtype.
void logprob_backward(const at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& g_lp,
                      const at::Tensor* g_ent, const at::Tensor* mean_z, at::Tensor& dz);
}  // namespace kiln::kernels::cuda
