#include "kernels/adamw.hpp"

#include <ATen/ATen.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_fused_adamw.h>

#ifdef KILN_CUDA
#include "kernels/adamw_cuda.hpp"
#endif

namespace kiln::kernels {

namespace {
// The checks both paths make (adamw.hpp's errors).
void check(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
           const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
           const std::vector<at::Tensor>& params, const at::Tensor& grad_scale, const std::vector<at::Tensor>& steps) {
  const auto n = masters.size();
  TORCH_CHECK(exp_avgs.size() == n && exp_avg_sqs.size() == n && grads.size() == n && params.size() == n &&
                  steps.size() == n,
              "adamw_step_low_precision: ", n, " masters but ", exp_avgs.size(), " exp_avgs, ", exp_avg_sqs.size(),
              " exp_avg_sqs, ", grads.size(), " gradients, ", params.size(), " parameters, ", steps.size(), " steps");
  TORCH_CHECK(grad_scale.defined() && grad_scale.numel() == 1 && grad_scale.scalar_type() == at::kFloat,
              "adamw_step_low_precision: grad_scale must be one fp32 element, got ",
              grad_scale.defined() ? grad_scale.sizes() : at::IntArrayRef{}, " ",
              grad_scale.defined() ? c10::toString(grad_scale.scalar_type()) : "undefined");
  if (n == 0) return;
  const auto low = grads.front().scalar_type();
  TORCH_CHECK(low == at::kBFloat16 || low == at::kHalf, "adamw_step_low_precision: gradients must be bf16 or fp16, got ",
              low);
  for (std::size_t i = 0; i < n; ++i) {
    const auto& m = masters[i];
    TORCH_CHECK(m.scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat &&
                    exp_avg_sqs[i].scalar_type() == at::kFloat,
                "adamw_step_low_precision: parameter ", i, "'s master and moments must be fp32, got ", m.scalar_type(),
                ", ", exp_avgs[i].scalar_type(), ", ", exp_avg_sqs[i].scalar_type());
    TORCH_CHECK(grads[i].scalar_type() == low && params[i].scalar_type() == low, "adamw_step_low_precision: parameter ",
                i, "'s gradient and parameter must be ", low, " (the first gradient's), got ", grads[i].scalar_type(),
                " and ", params[i].scalar_type());
    for (const auto* t : {&exp_avgs[i], &exp_avg_sqs[i], &grads[i], &params[i]})
      TORCH_CHECK(t->sizes() == m.sizes(), "adamw_step_low_precision: parameter ", i, " has a master of shape ",
                  m.sizes(), " and a tensor of shape ", t->sizes(), " beside it");
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat, "adamw_step_low_precision: parameter ",
                i, "'s step must be one fp32 element, got ", steps[i].sizes(), " ", steps[i].scalar_type());
  }
}
}  // namespace

bool adamw_step_low_precision_uses_kernel(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                                          const std::vector<at::Tensor>& exp_avg_sqs,
                                          const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                                          const at::Tensor& grad_scale, const std::vector<at::Tensor>& steps) {
#ifdef KILN_CUDA
  if (masters.empty() || !masters.front().is_cuda() || !grad_scale.defined()) return false;
  const auto dev = masters.front().device();
  const auto low = grads.empty() ? at::kBFloat16 : grads.front().scalar_type();
  if (low != at::kBFloat16 && low != at::kHalf) return false;
  auto here = [&](const at::Tensor& t, at::ScalarType dtype) {
    return t.defined() && t.device() == dev && t.scalar_type() == dtype && t.is_contiguous();
  };
  if (!here(grad_scale, at::kFloat) || grad_scale.numel() != 1) return false;
  if (exp_avgs.size() != masters.size() || exp_avg_sqs.size() != masters.size() || grads.size() != masters.size() ||
      params.size() != masters.size() || steps.size() != masters.size())
    return false;
  for (std::size_t i = 0; i < masters.size(); ++i)
    if (!here(masters[i], at::kFloat) || !here(exp_avgs[i], at::kFloat) || !here(exp_avg_sqs[i], at::kFloat) ||
        !here(grads[i], low) || !here(params[i], low) || !here(steps[i], at::kFloat) || steps[i].numel() != 1)
      return false;
  return true;
#else
  (void)masters, (void)exp_avgs, (void)exp_avg_sqs, (void)grads, (void)params, (void)grad_scale, (void)steps;
  return false;
#endif
}

void adamw_step_low_precision_ref(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                                  const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                                  const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                                  const std::vector<at::Tensor>& steps, const AdamWHyper& h) {
  check(masters, exp_avgs, exp_avg_sqs, grads, params, grad_scale, steps);
  if (masters.empty()) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> wide;  // the gradients in fp32, scaled as the clip scales them
  for (std::size_t i = 0; i < grads.size(); ++i)
    wide.push_back(grads[i].to(at::kFloat).mul_(grad_scale.reshape({}).to(masters[i].device())));
  at::_fused_adamw_(masters, wide, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, h.lr, h.beta1, h.beta2,
                    h.weight_decay, h.eps, /*amsgrad=*/false, /*maximize=*/false);
  at::_foreach_copy_(params, masters);
}

void adamw_step_low_precision(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                              const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& params, const at::Tensor& grad_scale,
                              const std::vector<at::Tensor>& steps, const AdamWHyper& h) {
#ifdef KILN_CUDA
  if (adamw_step_low_precision_uses_kernel(masters, exp_avgs, exp_avg_sqs, grads, params, grad_scale, steps)) {
    check(masters, exp_avgs, exp_avg_sqs, grads, params, grad_scale, steps);
    return cuda::adamw_step_low_precision(masters, exp_avgs, exp_avg_sqs, grads, params, grad_scale, steps,
                                          float(h.lr), float(h.beta1), float(h.beta2), float(h.weight_decay),
                                          float(h.eps));
  }
#endif
  adamw_step_low_precision_ref(masters, exp_avgs, exp_avg_sqs, grads, params, grad_scale, steps, h);
}

}  // namespace kiln::kernels
