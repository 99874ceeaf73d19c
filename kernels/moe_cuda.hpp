#pragma once
// Host entry points of kernels/moe.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// logits [T, E] fp32 contiguous, bias [E] fp32 -> ids [T, K] int64 (written).
void router_topk(const at::Tensor& logits, const at::Tensor& bias, at::Tensor& ids);
}  // namespace kiln::kernels::cuda
