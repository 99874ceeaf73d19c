#pragma once
// Host entry points of kernels/moe_dispatch.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
/// ids [T, K] int64 contiguous, M = T*K <= 1024, E <= 1024; the outputs written (int64).
void dispatch_order(const at::Tensor& ids, int64_t num_experts, at::Tensor& slot, at::Tensor& token_index,
                    at::Tensor& row_of_slot, at::Tensor& counts);
/// rows [M, D] contiguous, row_of_slot [M] int64, weights [T, K] fp32 contiguous -> out [T, D].
void moe_combine(const at::Tensor& rows, const at::Tensor& row_of_slot, const at::Tensor& weights, at::Tensor& out);
/// Largest M and E dispatch_order takes.
constexpr int64_t kDispatchMaxSlots = 1024, kDispatchMaxExperts = 1024;
}  // namespace kiln::kernels::cuda
