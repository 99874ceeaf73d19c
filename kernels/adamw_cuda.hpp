#pragma once
// Host entry point of kernels/adamw.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

#include <vector>

namespace kiln::kernels::cuda {
/// kernels::adamw_step_low_precision's kernel: the arguments as adamw_step_low_precision_uses_kernel
/// accepts them (one CUDA device, contiguous, fp32 masters and moments, bf16 or fp16 gradients and
/// parameters of one dtype, grad_scale and steps one fp32 element each); lr .. eps as fp32.
void adamw_step_low_precision(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                              const std::vector<at::Tensor>& steps, float lr, float beta1, float beta2,
                              float weight_decay, float eps);
}  // namespace kiln::kernels::cuda
