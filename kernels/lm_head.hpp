#pragma once
// The log-prob head's probabilities and the log-softmax's row statistics in one pass: on Hopper
// one CUTLASS GEMM (kernels/lm_head_sm90.cuh) writes each row's probabilities against a reference
// the caller gives and reduces each row in its epilogue, so the fp32 logits are never written to
// memory and read back (what the forward of model::token_logprobs did before: cuBLAS into fp32
// [n, V], then kernels/logprobs.cu's pass), and the backward reads the probabilities as they are
// (lm_head_probs_backward: no pass over [N, V] between its two GEMMs).
//   acc[t, v]    = sum_k hidden[t, k] weight[v, k]               (fp32 accumulation)
//   probs[t, v]  = bf16(min(exp(acc[t, v] - c[t]), 2^64))        (c: the caller's reference)
//   lse[t]       = log sum_v exp(acc[t, v])                      (the fp32 accumulators)
//   kept_lse[t]  = c[t] + log sum_v float(probs[t, v])           (the values stored)
// The sums as an online softmax's (reference, sum of exp(x - reference)) pairs in fp32 (Milakov &
// Gimelshein 2018; the reference a row's max or below it), merged across the GEMM's tiles; checked
// within 1e-5 (relative to 1 + |lse|) of an fp64 reference at GLM-4.7-Flash's head
// (tests/kernels/test_lm_head.cpp, on a Hopper GPU). The training head takes c = the row's target
// logit + 16 (kProbsReferenceMargin): the target's probability is then e^-16 or more of c, the
// row's largest e^(lse - c) at most, and every value within 71 of the max is a normal fp32/bf16.
//
// Legend: N rows (tokens), D hidden, V vocabulary.
#include <ATen/core/Tensor.h>

#include <utility>

namespace kiln::kernels {

/// Whether lm_head_probs_lse runs the fused GEMM for these inputs: a build with it (CUDA and
/// CUTLASS's headers), CUDA tensors on a device of compute capability 9.x, bf16, D and V multiples
/// of 8, and the switch on. On by default (faster than cuBLAS plus kiln's pass in the training
/// step and 1.7 GiB smaller at 8192 tokens on the H100; docs/benchmarks.md, "The fused head in
/// the training step"; docs/gpu.md); off with set_lm_head_fused(false) or KILN_LM_HEAD_FUSED=0
/// in the environment at start-up (another value: c10::Error naming it, at the first use).
bool lm_head_fused_available(const at::Tensor& hidden_ND, const at::Tensor& weight_VD);
/// The process-wide switch lm_head_fused_available reads (benchmarks and tests compare both
/// paths); returns the setting it replaces.
bool set_lm_head_fused(bool on);
/// The fused GEMM's kernel schedule, process-wide: cooperative (128x256 tiles, the default) or
/// pingpong (128x128 tiles, one warp group's epilogue under the other's mainloop), as
/// KILN_LM_HEAD_SCHEDULE=cooperative|pingpong in the environment at start-up. Which is faster
/// depends on the GPU (docs/benchmarks.md): the H100's 8k training step runs 0.7 ms faster with
/// cooperative; on the H200 the GEMM alone ran faster with pingpong (724 against 689 TFLOP/s at
/// T 1024). Same results up to the order the tiles' row statistics merge in (fp32 rounding).
enum class LmHeadSchedule { cooperative, pingpong };
/// Returns the schedule it replaces.
LmHeadSchedule set_lm_head_schedule(LmHeadSchedule s);
/// Throws c10::Error naming KILN_LM_HEAD_SCHEDULE's value when it is neither.
LmHeadSchedule lm_head_schedule();
/// Both settings for one scope (a test case, a benchmark's comparison), the previous ones back
/// however it ends.
class LmHeadSettingsScope {
 public:
  explicit LmHeadSettingsScope(bool fused, LmHeadSchedule schedule = LmHeadSchedule::cooperative)
      : fused_(set_lm_head_fused(fused)), schedule_(set_lm_head_schedule(schedule)) {}
  ~LmHeadSettingsScope() { set_lm_head_fused(fused_), set_lm_head_schedule(schedule_); }
  LmHeadSettingsScope(const LmHeadSettingsScope&) = delete;
  LmHeadSettingsScope& operator=(const LmHeadSettingsScope&) = delete;

 private:
  bool fused_;
  LmHeadSchedule schedule_;
};

/// hidden_ND [N, D] and weight_VD [V, D] bf16, contiguous, on one CUDA device; reference_N [N]
/// fp32 on it (each row's c, nats); probs_NV [N, V] bf16 contiguous on it, receives the
/// probabilities. -> (lse [N], kept_lse [N]) fp32, as the legend above. Needs
/// lm_head_fused_available; throws c10::Error naming the shape, dtype or device that does not
/// fit, std::runtime_error when CUTLASS refuses the problem or the launch fails.
std::pair<at::Tensor, at::Tensor> lm_head_probs_lse(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                                    const at::Tensor& reference_N, const at::Tensor& probs_NV);
/// The training head's reference: c = target logit + kProbsReferenceMargin (nats).
constexpr double kProbsReferenceMargin = 16;
/// The largest lse - c for which lm_head_probs_backward reads a row's probabilities (2^64, where
/// the GEMM clamps them, is e^44.4): a row past it (a target's log-prob below about -56) is
/// recomputed on its own.
constexpr double kProbsMaxLseAboveReference = 40;
/// The backward of logp[t] = acc[t, target[t]] - lse[t] (the log-prob head, kernels/logprobs.hpp's
/// formula) from lm_head_probs_lse's outputs, for the rows of probs_NV:
///   dz[t, v] = g[t] (onehot(target[t])_v - probs[t, v] exp(c[t] - kept_lse[t]))
///            = a[t] (probs[t, v] - S[t] onehot_v),   a = -g exp(c - kept_lse), S = exp(kept_lse - c)
/// probs_NV gets S subtracted at each row's target (in place; then it is dz / a), and
///   grad_hidden = a * (probs @ weight)      [N, D] in hidden's dtype (fp32 GEMM output, scaled once)
///   grad_weight = probs^T @ (a * hidden)    [V, D] in weight_grad_dtype
/// so neither GEMM waits on a pass over [N, V]. g_N [N] fp32 is dL/dlogp; a row whose target lies
/// outside [0, V) or whose g is 0 gets no gradient. A row with a gradient whose lse - c is above
/// kProbsMaxLseAboveReference or not finite (its probabilities may be clamped) takes a = 0 there
/// and is done as the default path does it: its fp32 logits recomputed (256 such rows at a time),
/// dz = g (onehot - exp(z - lse)) in hidden's dtype, its hidden row and its share of the weight's
/// gradient from that, the weight's gradient then computed again in fp32 (how many such rows is
/// counted on the device and read by the host once both GEMMs are queued: no wait for the GPU
/// before them; with none, the common case, nothing else runs). Any device
/// (LibTorch ops; on CUDA with 16-bit inputs the GEMMs accumulate in fp32). grad_weight_into
/// (optional; fp32 [V, D] contiguous on the weight's device, weight_grad_dtype fp32): the weight's
/// gradient is added into it in place (on CUDA by the GEMM itself, beta = 1) and it is returned
/// as the second result — a chunked caller's running sum, no second [V, D]. Throws c10::Error on
/// shapes, and on a grad_weight_into that does not fit.
std::pair<at::Tensor, at::Tensor> lm_head_probs_backward(const at::Tensor& probs_NV, const at::Tensor& hidden_ND,
                                                         const at::Tensor& weight_VD, const at::Tensor& targets_N,
                                                         const at::Tensor& reference_N, const at::Tensor& lse_N,
                                                         const at::Tensor& kept_lse_N, const at::Tensor& g_N,
                                                         at::ScalarType weight_grad_dtype,
                                                         const at::Tensor& grad_weight_into = at::Tensor());
/// Each row's log-prob of its target from the fused GEMM's lse: hidden_ND[t] . weight_VD[targets_N[t]]
/// (fp32 products and sums) - lse_N[t], and 0 where targets_N[t] is outside [0, V) (as
/// kernels/logprobs.cu's forward; a target < 0 marks a row without one): what the GEMM's
/// epilogue, which reduces rows, does not pick out. hidden_ND [N, D] and weight_VD [V, D] of one dtype, targets_N [N] int64 and lse_N [N] fp32
/// on their device -> [N] fp32. On CUDA with bf16 and D a multiple of 8: one kernel, a warp per
/// row (kernels/lm_head_targets.cu); elsewhere lm_head_target_logprobs_ref. Throws c10::Error
/// naming a shape, dtype or device that does not fit.
at::Tensor lm_head_target_logprobs(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                   const at::Tensor& targets_N, const at::Tensor& lse_N);
/// Each row's target logit, hidden_ND[t] . weight_VD[targets_N[t]] in fp32 (0 where the target is
/// outside [0, V)): lm_head_target_logprobs with an lse of 0 (the fused head's reference is this
/// + kProbsReferenceMargin, its log-prob this - lse).
at::Tensor lm_head_target_logits(const at::Tensor& hidden_ND, const at::Tensor& weight_VD, const at::Tensor& targets_N);
/// The LibTorch composite, any device: the target rows gathered, both sides in fp32, product, sum.
at::Tensor lm_head_target_logprobs_ref(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                       const at::Tensor& targets_N, const at::Tensor& lse_N);
/// The LibTorch reference, any device: fp32 logits (on CUDA with 16-bit inputs one GEMM writing
/// fp32, as model::lm_logits; elsewhere an fp32 GEMM of the inputs) and their logsumexp;
/// probs_NV receives min(exp(logits - c), 2^64) rounded to its dtype, and kept_lse is c + log of
/// their fp32 sum.
std::pair<at::Tensor, at::Tensor> lm_head_probs_lse_ref(const at::Tensor& hidden_ND, const at::Tensor& weight_VD,
                                                        const at::Tensor& reference_N, const at::Tensor& probs_NV);

}  // namespace kiln::kernels
