#pragma once
// MoE kernels. Legend: T tokens, E experts, K experts per token, M = T*K rows in expert
// order, D hidden, F expert intermediate.
//
// grouped_swiglu: the routed experts' SwiGLU on rows already sorted by expert,
//   y[r] = W_down[e] (silu(W_gate[e] x[r]) * W_up[e] x[r])   for the rows r of expert e,
// matching transformers' Glm4MoeLiteExperts. x [M, D]; counts [E] int64 (rows per expert, any
// device); w_gate_up_EFD [E, 2F, D] (gate rows then up rows); w_down_EDF [E, D, F] -> [M, D].
// CUDA bf16 tensors with D and F multiples of 8 run two grouped GEMMs for all experts at once
// (offsets computed on the device, no host sync): kiln's (kernels/grouped_gemm.hpp) on Hopper in
// a build with CUTLASS's headers, else at::_grouped_mm; anything else runs the LibTorch
// reference, one GEMM pair per expert with rows (counts read on host). Differentiable in x and
// both weights either way.
// Inside a kernels::DecodeExpertsGuard (kernels/moe_decode.hpp), with grad mode off and few rows,
// it runs the decode-step kernels of kernels/moe_decode.hpp instead (no autograd there).
// swiglu_limit (GLM-5.3-Flash's Glm5NextTextExperts): the activation is swiglu(gate, up, limit).
//
// routed_experts_combine (training): the dispatch's gather, grouped_swiglu and moe_combine as
// one differentiable function,
//   y[t] = sum_k weights[t, k] * grouped_swiglu(x[token_index], counts, ...)[row_of_slot[t*K + k]]
// x [T, D]; token_index, slot, row_of_slot [M] int64 and counts [E] (kernels::dispatch_order);
// weights [T, K] fp32 -> y [T, D] in x's dtype. The forward runs the same kernels as those three
// steps (the same bits), but keeps only gu [M, 2F] (the gate/up projection) besides what the
// caller holds (x, the order, the weights): the backward gathers x's rows again, recomputes the
// activation (swiglu_routed_backward, kernels/swiglu.hpp) and takes the combine weights'
// gradient from the down projection's input gradient, sum_f h[r, f] act[r, f], which equals
// sum_d rows[r, d] grad_y[t, d] (h = grad_y[t] W_down[e], rows = act W_down[e]^T) — so the
// gathered rows [M, D], the activation [M, F] and the experts' output rows [M, D] are not kept
// (at 32768 tokens, 64 experts top-4, D 2048, F 1536: 1.4 GiB per MoE layer in bf16). The
// backward's weight gradient of W_down is grad_rows^T (w * act) per expert (the weight applied
// to the activation, where autograd applied it to grad_y). Grouped GEMMs as grouped_swiglu
// picks them (kiln's when chosen, else at::_grouped_mm); elsewhere one GEMM per expert with
// rows (counts read on the host). Differentiable in x, both weights and the combine weights.
//
// swiglu: silu(gate) * up; with a limit, transformers' clamped form (Glm5NextTextExperts,
// Glm5NextTextMLP): gate clamped to <= limit and up to [-limit, limit] first (no gradient
// through a clamped entry, as torch.clamp). gate, up: same shape, any dtype -> that shape.
//
// router_topk: the expert choice of DeepSeek-V3's router (arXiv:2412.19437 §2.1.2) with one
// group: scores = sigmoid(logits), ids = top-K of (scores + bias), by descending biased score.
// logits [T, E] fp32, bias [E] fp32 -> ids [T, K] int64. CUDA: one warp per token fusing the
// sigmoid, the bias and K rounds of warp arg-max (E <= 512, K <= 16); otherwise LibTorch topk.
// Ties break toward the lower expert id in the kernel; torch::topk leaves tie order unspecified.
// router_topk_weights (inference, no autograd): router_topk's ids and the weights of
// model::route_from_scores: w[t, k] = sigmoid(logits[t, ids[t, k]]), divided by (their sum over
// k + 1e-20) when norm_topk_prob, times routed_scaling_factor -> (ids [T, K] int64, weights
// [T, K] fp32). Kernel and reference both sum over k in k order (sum_in_slot_order): the same bits.
// sum_in_slot_order: w [T, K] -> [T, 1], w[:, 0] + w[:, 1] + ... added left to right
// (elementwise, differentiable), not by a reduction whose order over K is LibTorch's.
// Throws c10::Error on shape or dtype mismatch.
#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace kiln::kernels {

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, std::optional<double> limit = std::nullopt);
at::Tensor grouped_swiglu(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w_gate_up_EFD,
                          const at::Tensor& w_down_EDF, std::optional<double> swiglu_limit = std::nullopt);
at::Tensor grouped_swiglu_ref(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& w_gate_up_EFD,
                              const at::Tensor& w_down_EDF, std::optional<double> swiglu_limit = std::nullopt);
/// True when grouped_swiglu takes the grouped-GEMM path for these inputs.
bool grouped_swiglu_uses_grouped_mm(const at::Tensor& x, const at::Tensor& w_gate_up_EFD);

at::Tensor routed_experts_combine(const at::Tensor& x_TD, const at::Tensor& token_index_M, const at::Tensor& slot_M,
                                  const at::Tensor& row_of_slot_M, const at::Tensor& counts_E,
                                  const at::Tensor& w_gate_up_EFD, const at::Tensor& w_down_EDF,
                                  const at::Tensor& weights_TK, std::optional<double> swiglu_limit = std::nullopt);

at::Tensor router_topk(const at::Tensor& logits_TE, const at::Tensor& bias_E, int64_t k);
at::Tensor router_topk_ref(const at::Tensor& logits_TE, const at::Tensor& bias_E, int64_t k);
at::Tensor sum_in_slot_order(const at::Tensor& w_TK);
std::pair<at::Tensor, at::Tensor> router_topk_weights(const at::Tensor& logits_TE, const at::Tensor& bias_E,
                                                      int64_t k, bool norm_topk_prob, double routed_scaling_factor);
std::pair<at::Tensor, at::Tensor> router_topk_weights_ref(const at::Tensor& logits_TE, const at::Tensor& bias_E,
                                                          int64_t k, bool norm_topk_prob, double routed_scaling_factor);

}  // namespace kiln::kernels
