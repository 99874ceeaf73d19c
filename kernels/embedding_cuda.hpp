#pragma once
// Host entry point of kernels/embedding.cu (CUDA builds only); arguments checked by the caller
// (kernels/embedding.cpp).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// dy [T, D] (contiguous, 16-byte aligned, D a multiple of 16 bytes' elements), ids [T] int64
/// in [0, V) -> dweight [V, D] contiguous (every row written).
void embedding_backward(const at::Tensor& dy, const at::Tensor& ids, at::Tensor& dweight);
}  // namespace kiln::kernels::cuda
