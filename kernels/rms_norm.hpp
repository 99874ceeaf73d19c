#pragma once
// Fused RMSNorm, forward and backward. Math as transformers' Glm4MoeLiteRMSNorm:
//   rstd = rsqrt(mean(x_fp32^2, -1) + eps)            (fp32)
//   y    = w * (x_fp32 * rstd).to(x.dtype)
// x: [R, D] (leading dims flattened; contiguous), w: [D], dtype fp32, bf16 or fp16 (x and w
// alike). CUDA tensors run kernels/rms_norm.cu (one block per row, fp32 accumulation); other
// devices the LibTorch reference below. Throws c10::Error on shape or dtype mismatch, and on
// CUDA tensors in a build without CUDA.
#include <ATen/core/Tensor.h>

#include <tuple>

namespace kiln::kernels {

/// -> (y [R, D] in x.dtype, rstd [R] fp32).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps);
/// -> (dx [R, D] in x.dtype, dw [D] in w.dtype, accumulated in fp32).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd);
/// LibTorch references, any device.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_ref(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_ref(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                         const at::Tensor& rstd);
/// Differentiable in x and w (forward/backward above). x: [..., D] -> [..., D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
/// True when this build has the CUDA kernels.
bool built_with_cuda();

}  // namespace kiln::kernels
