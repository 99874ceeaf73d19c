#pragma once
// Host entry points of kernels/moe_dispatch.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// ids [T, K] int64 contiguous, M = T*K <= 1024, E <= 1024; the outputs written (int64).
void dispatch_order(const at::Tensor& ids, int64_t num_experts, at::Tensor& slot, at::Tensor& token_index,
                    at::Tensor& row_of_slot, at::Tensor& counts);
/// rows [M, D] contiguous, row_of_slot [M] int64, weights [T, K] fp32 contiguous -> out [T, D].
void moe_combine(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& weights, at::Tensor& out);
/// rows [M, D], row_of_slot [M] int64, weights [T, K] fp32, grad [T, D] in rows' dtype, all
/// contiguous -> grad_rows [M, D] (rows' dtype), grad_weights [T, K] fp32.
void moe_combine_backward(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& weights,
                          const at::Tensor& grad, at::Tensor& grad_rows, at::Tensor& grad_weights);
/// Largest M and E dispatch_order takes.
constexpr int64_t kDispatchMaxSlots = 1024, kDispatchMaxExperts = 1024;
}  // namespace kiln::kernels::cuda
