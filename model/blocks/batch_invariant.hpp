#pragma once
// The blocks' batch-invariant forward for the true on-policy mode (CausalLM::set_batch_invariant,
// experiment key algorithm.true_on_policy; docs/gpu.md): differentiable wrappers of the
// batch-invariant ops of kernels/batch_invariant.hpp, whose values depend on each row's own
// inputs alone, bit for bit (whatever the rows around it), so that the trainer's packed forward
// and the rollout engine's prefill and decode agree exactly. Only the forward values must be
// invariant: gradients come from the ordinary differentiable op, recomputed in the backward
// (invariant_forward; for linear a direct g W / g^T x), so the gradients are the ordinary ones
// at the same point and the optimizer sees what the default mode would give up to rounding.
// Source: Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al. 2025);
// slime/miles "true on-policy" (SGLang + FSDP).
// Legend: T tokens, K reduced dim, N output columns, M rows, E experts, F expert intermediate,
// H heads, D hidden.
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <vector>

namespace kiln::model {

using TensorsFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

/// The generic helper, written once: returns invariant(inputs) (run without recording a graph),
/// differentiable in every floating input with the gradients of reference(inputs): the
/// backward runs reference on detached copies of the inputs under grad mode and differentiates
/// it (torch::autograd::grad) against the incoming gradient. Both functions take the inputs in
/// the given order and must return tensors of the same shape. Without grad mode, or when no
/// input requires a gradient, it is invariant(inputs) alone.
torch::Tensor invariant_forward(const TensorsFn& invariant, const TensorsFn& reference,
                                const std::vector<torch::Tensor>& inputs);

/// y = x W^T by kernels::bi_linear: x [..., K], w [N, K] (same dtype) -> [..., N] in out_dtype
/// (default x's). Backward: dx = g W, dW = g^T x (ordinary GEMMs, in x's dtype).
torch::Tensor invariant_linear(const torch::Tensor& x, const torch::Tensor& w,
                               std::optional<torch::ScalarType> out_dtype = std::nullopt);

/// RMSNorm by kernels::bi_rms_norm (model/blocks/basic.hpp's formula): x [..., D], w [D] ->
/// [..., D] in x's dtype. Gradients of model::rms_norm.
torch::Tensor invariant_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

/// Causal attention over packed documents (kernels/attention.hpp's varlen_attention) by
/// kernels::bi_attention with cu_q = cu_k = cu_seqlens: q [T, H, Dqk], k [T, H, Dqk],
/// v [T, H, Dv] -> [T, H, Dv]; cu_seqlens [B+1] int32/int64 on any device; max_seqlen for the
/// reference (0: read off cu_seqlens). Gradients of kernels::varlen_attention.
torch::Tensor invariant_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& cu_seqlens, double scale, int64_t max_seqlen = 0);

/// silu(x) = x sigmoid(x) as x / (1 + exp(-x)) in fp32, rounded to x's dtype once: composed of
/// elementwise ops that give each element the same bits wherever it sits (ATen's CPU silu and
/// sigmoid do not: their vectorised body and scalar tail round differently). Differentiable.
torch::Tensor invariant_silu(const torch::Tensor& x);
/// sigmoid(x) = 1 / (1 + exp(-x)), elementwise as invariant_silu; x's dtype. Differentiable.
torch::Tensor invariant_sigmoid(const torch::Tensor& x);
/// SwiGLU's activation silu(gate) * up (kernels::swiglu without a limit). gate, up: same shape.
torch::Tensor invariant_swiglu(const torch::Tensor& gate, const torch::Tensor& up);

/// The routed experts' SwiGLU on rows sorted by expert (kernels::grouped_swiglu's contract):
/// two kernels::bi_grouped_linear with invariant_swiglu between. x [M, D], counts [E] int64,
/// w_gate_up_EFD [E, 2F, D], w_down_EDF [E, D, F] -> [M, D]. Gradients of
/// kernels::grouped_swiglu. Throws std::invalid_argument for a swiglu_limit (no clamped form
/// in this mode: GLM-5.3-Flash, whose experts clamp, does not support it).
torch::Tensor invariant_grouped_swiglu(const torch::Tensor& x, const torch::Tensor& counts,
                                       const torch::Tensor& w_gate_up_EFD, const torch::Tensor& w_down_EDF,
                                       std::optional<double> swiglu_limit = std::nullopt);

/// A block that has a batch-invariant forward: the model's switch (CausalLM::set_batch_invariant)
/// turns it on in each of its blocks.
class BatchInvariantSwitch {
 public:
  void set_batch_invariant(bool on) { batch_invariant_ = on; }
  bool batch_invariant() const { return batch_invariant_; }

 protected:
  bool batch_invariant_ = false;
};

}  // namespace kiln::model
