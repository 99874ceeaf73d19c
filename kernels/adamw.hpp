#pragma once
// AdamW over fp32 master weights that takes its gradients from the 16-bit parameters and writes
// the updated masters back into them rounded, in one pass over memory (mixed-precision training
// as Micikevicius et al. 2018, arXiv:1710.03740, keep it: fp32 masters and moments, 16-bit
// weights and gradients). For parameter i, every tensor of it the same shape:
//
//   g        = float(grads[i]) * grad_scale                 (grad_scale: the clip coefficient)
//   master  -= lr * weight_decay * master                   (decoupled decay, arXiv:1711.05101)
//   exp_avg  = beta1 * exp_avg + (1 - beta1) * g
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
//   master  -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
//   params[i] = master rounded to params[i]'s dtype (to nearest even)
//
// The arithmetic is torch.optim.AdamW(fused=True)'s (ATen/native/cuda/fused_adam_utils.cuh,
// adam_math in ADAMW mode: fp32 opmath, the moments as fma(beta, m, fma(-beta, g, g)), the bias
// corrections from the fp32 step count, sqrt and divisions rounded), so the kernel and the
// reference below agree to within fp32 rounding of the compiler's contractions (on an H100,
// 2026-12-05: within the test's 2-ulp bound in every configuration, and bit for bit in those it
// printed; tests/kernels/test_adamw.cpp). Against torch::optim::AdamW (not fused)
// the second moment differs by 1.3e-5 relative: the fused formula's (1 - beta2) is taken with beta2
// in fp32.
//
// Memory per parameter element: reads master, exp_avg, exp_avg_sq (fp32) and the gradient (16-bit),
// writes master, exp_avg, exp_avg_sq and the parameter: 28 bytes with bf16, against 44 for the
// composite it replaces (gradient widened into an fp32 copy, LibTorch's fused AdamW over it, the
// masters copied out; 52 when the clip scales that copy), and no fp32 gradient is allocated.
//
// CUDA (one launch for all parameters: a table of them uploaded per call, chunks of 64K elements
// per block, 16-byte loads where every operand of a parameter starts on its vector boundary) when
// adamw_step_low_precision_uses_kernel; anything else (CPU, another dtype, strided tensors): the
// reference, LibTorch ops that compute the same values.
#include <ATen/core/Tensor.h>

#include <vector>

namespace kiln::kernels {

/// Bytes the step moves per parameter element with 16-bit gradients and parameters: master,
/// exp_avg and exp_avg_sq read and written (fp32), gradient read and parameter written (16-bit).
inline constexpr double kAdamWLowPrecisionBytesPerParameter = 3 * 2 * 4 + 2 + 2;

/// One step's hyper-parameters, torch.optim.AdamW's names and meaning (used as fp32, as the fused
/// kernel casts them).
struct AdamWHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, weight_decay = 0.0, eps = 1e-8;
};

/// The step above over n parameters, in place.
///   masters, exp_avgs, exp_avg_sqs  n tensors, fp32, each the shape of its parameter: read, written
///   grads                           n tensors, bf16 or fp16 (one dtype for all): read
///   params                          n tensors, grads' dtype, each the shape of its master: written
///   grad_scale                      one fp32 element on the masters' device (a [] or [1] tensor):
///                                   the factor every gradient element is multiplied by first (the
///                                   clip coefficient min(1, max_norm / (norm + 1e-6)); 1 for none),
///                                   read by the kernel, so no host synchronisation
///   steps                           n fp32 one-element tensors on the masters' device: each
///                                   parameter's step count after this step's increment (torch's
///                                   fused AdamW takes it the same way); several may be one tensor
/// A gradient with a non-finite element makes its parameter's master non-finite, as torch's does:
/// the caller checks the norm first (the trainer skips such a step).
/// Throws c10::Error when the lists differ in length, a tensor's shape differs from its master's,
/// a master or moment is not fp32, the gradients are not one 16-bit dtype, or a parameter's dtype
/// is not its gradient's.
void adamw_step_low_precision(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                              const std::vector<at::Tensor>& steps, const AdamWHyper& hyper);

/// The reference: each gradient widened to fp32 and multiplied by grad_scale, at::_fused_adamw_
/// over the masters (LibTorch's fused AdamW, CPU or CUDA), the masters copied into the parameters
/// (at::_foreach_copy_). Same arguments, checks and errors.
void adamw_step_low_precision_ref(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                                  const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                                  const std::vector<at::Tensor>& steps, const AdamWHyper& hyper);

/// True when adamw_step_low_precision runs the CUDA kernel for these arguments: a CUDA build, every
/// tensor on one CUDA device and contiguous, the dtypes above, grad_scale and every step one fp32
/// element there.
bool adamw_step_low_precision_uses_kernel(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                                          const std::vector<at::Tensor>& exp_avg_sqs,
                                          const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                                          const at::Tensor& grad_scale, const std::vector<at::Tensor>& steps);

}  // namespace kiln::kernels
