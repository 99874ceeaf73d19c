#pragma once
// Fused RMSNorm, forward and backward. Math as transformers' Glm4MoeLiteRMSNorm:
//   rstd = rsqrt(mean(x_fp32^2, -1) + eps)            (fp32)
//   y    = w * (x_fp32 * rstd).to(x.dtype)
// x: [R, D] (leading dims flattened; any layout: a view whose rows have unit column stride and
// start on 16-byte boundaries is read in place, others are copied), w: [D], dtype fp32, bf16 or
// fp16 (x and w alike). CUDA tensors run kernels/rms_norm.cu (a warp per row where a row is at most
// 8 16-byte vectors a lane, else a block per row; fp32 accumulation); other devices the LibTorch
// reference below. Outputs are contiguous. Throws c10::Error on shape or dtype mismatch, and on
// CUDA tensors in a build without CUDA.
#include <ATen/core/Tensor.h>

#include <tuple>
#include <utility>

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

/// The pre-norm residual block's two norms with the residual stream's additions folded in (the
/// forward's `h = x + r` before a norm, and the backward's sum of a norm's input gradient with
/// the gradient of the stream going on), each one pass on CUDA where the warp kernels take the
/// rows (else the same values by at::add and the kernels above). The values are those of the
/// unfused ops, bit for bit: h rounded as at::add rounds it, the norm's dx rounded and then
/// summed with the other gradient and rounded again, as autograd sums a tensor's gradients.
/// x, r [..., D], w [D], one dtype and device. Differentiable in x, r and w.
///
/// add_rms_norm(x, r, w) -> {h = x + r, y = rms_norm(h, w)}; backward dx = dr = dh + (norm's dx).
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                               double eps);
/// rms_norm_pass(x, w) -> {x_on, y = rms_norm(x, w)}: x_on holds x's values and carries the
/// stream on (use it in place of x); backward dx = d x_on + (norm's dx).
std::pair<at::Tensor, at::Tensor> rms_norm_pass(const at::Tensor& x, const at::Tensor& w, double eps);
/// True when this build has the CUDA kernels.
bool built_with_cuda();

}  // namespace kiln::kernels
