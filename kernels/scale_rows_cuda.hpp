#pragma once
// Host entry point of kernels/scale_rows.cu (CUDA builds only); arguments checked by the caller
// (kernels/scale_rows.cpp: scale_rows_uses_kernel).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// out [N, D] = x [N, D] * a [N] per row, fp32 product rounded once, on the current stream.
void scale_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a);
}  // namespace kiln::kernels::cuda
