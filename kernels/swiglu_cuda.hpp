#pragma once
// Host entry points of kernels/swiglu.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// gu [M, 2F] bf16 or fp16 contiguous, F % 8 == 0 -> out [M, F] (gu's dtype, contiguous).
void swiglu_packed_forward(const at::Tensor& gu, at::Tensor& out);
/// gu [M, 2F], dy [M, F] (gu's dtype, contiguous) -> dgu [M, 2F] (contiguous).
void swiglu_packed_backward(const at::Tensor& gu, const at::Tensor& dy, at::Tensor& dgu);
}  // namespace kiln::kernels::cuda
