#pragma once
// Host entry point of kernels/moe_decode.cu (CUDA builds only). x [M, D], w1 [E, 2F, D], w2
// [E, D, F] bf16 contiguous, counts [E] int64 on the same device; y [M, D] and act [M, F] bf16
// are written. limit: the SwiGLU clamp, +inf for none.
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
void grouped_swiglu_decode(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w1, const at::Tensor& w2,
                           float limit, at::Tensor& act, at::Tensor& y);
}  // namespace kiln::kernels::cuda
