#pragma once
// Host entry point of kernels/rope.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// out [T, H, R] contiguous; the arguments as kernels::rope_rotate's, checked by the caller.
void rope_rotate(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                 const at::Tensor& sin_table, bool interleaved, at::Tensor& out);
}  // namespace kiln::kernels::cuda
