#pragma once
// Whether training's feed-forward blocks recompute cheap activations in the backward instead of
// keeping them (process-wide, like kernels::set_lm_head_fused): on, the routed experts keep only
// their gate/up projection (GroupedExpertsImpl::forward_and_combine, kernels::routed_experts_combine)
// and the SwiGLU MLPs (dense and shared experts) their gate and up, not the activation; off, autograd
// keeps everything the separate steps save. The forward's values are the same either way; the
// gradients agree to rounding (tests/kernels/test_routed_experts.cpp). The trade at GLM-4.7-Flash's
// shapes is measured in docs/benchmarks.md. On by default; KILN_RECOMPUTE_IN_BACKWARD=0 in the
// environment at start-up turns it off (another value: c10::Error naming it, at the first use).
namespace kiln::model {

bool recompute_in_backward();
/// Returns the setting it replaces.
bool set_recompute_in_backward(bool on);

}  // namespace kiln::model
