#pragma once
// Host entry points of kernels/rms_norm.cu (CUDA builds only).
#include <ATen/core/Tensor.h>

namespace kiln::kernels::cuda {
void rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y, at::Tensor& rstd);
void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& rstd,
                       at::Tensor& dx, at::Tensor& dw_fp32);
}  // namespace kiln::kernels::cuda
