#pragma once
// Host entry point of kernels/mla_decode.cu (CUDA builds only); checked by kernels/mla_decode.cpp.
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// Widths the kernel is compiled for (C, R).
bool mla_decode_widths_supported(int64_t c, int64_t r);
/// q_latent [B, H, C], q_rope [B, H, R], cache [G, Z, C+R] bf16 contiguous; block_table [B, W],
/// lengths [B] int64 contiguous; out [B, H, C] bf16.
void mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_rope, const at::Tensor& cache,
                          const at::Tensor& block_table, const at::Tensor& lengths, double scale, at::Tensor& out);
}  // namespace kiln::kernels::cuda
