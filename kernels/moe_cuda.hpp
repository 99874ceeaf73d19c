#pragma once
// Host entry points of kernels/moe.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// logits [T, E] fp32 contiguous, bias [E] fp32 -> ids [T, K] int64 (written); with weights
/// ([T, K] fp32), also the routing weights (kernels::router_topk_weights).
void router_topk(const at::Tensor& logits, const at::Tensor& bias, at::Tensor& ids, at::Tensor* weights = nullptr,
                 bool norm = false, double scale = 1.0);
}  // namespace kiln::kernels::cuda
