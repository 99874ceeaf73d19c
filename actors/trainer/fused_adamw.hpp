#pragma once
// The optimizer step in multi-tensor launches: AdamW with LibTorch's fused kernel
// at::_fused_adamw_ (the kernel of torch.optim.AdamW(fused=True), CPU and CUDA), gradient-norm
// clipping with at::_foreach_norm / at::_foreach_mul_, and the copy of fp32 master weights into
// bf16 parameters with at::_foreach_copy_. A step costs a few launches per (device, dtype)
// group instead of ~10 small ops per parameter (torch::optim::AdamW::step).
//
// The AdamW state stays where torch::optim::AdamW keeps it (AdamWParamState: exp_avg,
// exp_avg_sq, max_exp_avg_sq, the integer step count), so checkpoints of the optimizer
// (torch::save / torch::load of it) are unchanged and either step can follow the other.
#include <torch/torch.h>

#include <utility>
#include <vector>

namespace kiln::trainer {

/// Gradients an AdamW step takes from 16-bit parameters instead of their fp32 masters' .grad():
/// masters[i] (a parameter of the optimizer, fp32, without a gradient of its own) steps on
/// float(grads[i]) * scale and its rounded value is written into params[i], in one pass
/// (kernels::adamw_step_low_precision: no fp32 gradient, no separate copy-out). Each grads[i]
/// may be undefined (no gradient: no step, as for a master without one).
struct LowPrecisionGradients {
  std::vector<torch::Tensor> masters, grads, params;
  torch::Tensor scale;  ///< [] fp32 on the masters' device: the clip coefficient (1: none)
};

/// One AdamW step over the parameters of `adamw` (every param group, at its options: lr,
/// betas, eps, weight_decay, amsgrad) that have a gradient; the others are skipped as
/// torch::optim::AdamW::step skips them (no update, no state, no step count). A parameter's
/// first step creates its state as torch does (zero moments, step 0); its step count is
/// incremented before the kernel, which reads it as an fp32 scalar on the parameter's device
/// (torch/optim/adam.py `_fused_adam`). One at::_fused_adamw_ launch per (param group,
/// device, dtype). Arithmetic: torch's fused kernel (decoupled decay p *= 1 - lr * wd, then
/// Adam with bias corrections), equal to torch::optim::AdamW::step up to fp32 rounding
/// (relative error ~1e-7 per step; tests/trainer/test_fused_adamw.cpp).
/// Throws std::invalid_argument naming the parameter (index in its group) when its gradient
/// or its state (e.g. from a checkpoint) differs from it in shape, dtype or device, or a
/// gradient is sparse; every parameter is checked before any is stepped, so a refusal changes
/// no parameter, state or step count.
/// With `low`: its masters step from its 16-bit gradients as LowPrecisionGradients says, at the
/// same state, options and step counts, in one kernels::adamw_step_low_precision call per param
/// group. Also refused (std::invalid_argument): a master that has a .grad() of its own, one of
/// another shape, device or dtype than its fp32 master / 16-bit gradient and parameter, amsgrad,
/// a scale that is not one fp32 element, lists of different lengths.
void fused_adamw_step(torch::optim::AdamW& adamw, const LowPrecisionGradients* low = nullptr);

/// The global L2 norm of `grads` (undefined ones skipped; any mix of dtypes and devices: each
/// tensor's norm in fp32 by at::_foreach_norm, one launch per (device, dtype) group, so a bf16
/// gradient's norm equals its fp32 copy's) and the clip coefficient min(1, max_norm / (norm +
/// 1e-6)), both [] fp32 on the first gradient's device, not read (no synchronisation). No
/// gradient: a norm of 0 and a coefficient of 1 on the CPU.
std::pair<torch::Tensor, torch::Tensor> grad_norm_and_coefficient(const std::vector<torch::Tensor>& grads,
                                                                  double max_norm);

/// Clips the gradients of `params` (those without one are ignored) to a global L2 norm of at
/// most `max_norm`, as torch::nn::utils::clip_grad_norm_(params, max_norm) does: total = the
/// L2 norm of the per-tensor norms (grad_norm_and_coefficient), coefficient min(1, max_norm /
/// (total + 1e-6)) computed on the device in fp32; the gradients are multiplied by it in
/// at::_foreach_mul_ launches only when it is below 1 (at 1 the product is the gradient).
/// Returns the total norm (0 when no parameter has a gradient; NaN or inf when a gradient is
/// not finite: an infinite norm multiplies them by 0 as torch does; a NaN one leaves them,
/// where torch multiplies them by NaN).
/// Synchronises with the device once.
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm);

/// The clip of clip_grad_norm over `grads` (undefined ones skipped), where only the gradients in
/// `scale_now` are multiplied by the coefficient (when below 1): the others take it later (the
/// one-pass AdamW reads it on the device, LowPrecisionGradients::scale). Returns the norm (read
/// on the host: one synchronisation) and the coefficient ([] fp32 on the first gradient's device).
std::pair<double, torch::Tensor> clip_gradients(const std::vector<torch::Tensor>& grads, double max_norm,
                                                const std::vector<torch::Tensor>& scale_now);

/// dst[i].copy_(src[i]) for every i (same shapes; dtypes may differ: fp32 masters into bf16
/// parameters round to nearest even, as copy_ does), in one at::_foreach_copy_ launch per
/// (device, dst dtype, src dtype) group. No autograd: dst may be leaves that require grad.
void copy_tensors(const std::vector<torch::Tensor>& dst, const std::vector<torch::Tensor>& src);

}  // namespace kiln::trainer
