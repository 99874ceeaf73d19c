#pragma once
// Host entry point of kernels/embedding.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// grad [T, D] contiguous (fp32/bf16/fp16, rows of a multiple of 16 bytes, 16-byte aligned),
/// order [T] int64 (token indices sorted by id, stable), offsets [V + 1] int64 (row v's tokens
/// are order[offsets[v] .. offsets[v + 1])), out [V, D] contiguous in grad's dtype.
void embedding_backward(const at::Tensor& grad, const at::Tensor& order, const at::Tensor& offsets, at::Tensor& out);
}  // namespace kiln::kernels::cuda
