#pragma once
// Per-token log-probabilities of given targets straight from the final hidden states, in
// chunks of tokens: forward and backward hold at most [chunk, V] fp32 values, never [T, V]
// in fp32 (with V = 154880 the full fp32 logits would be the memory peak of a training step).
// When a backward will run and the model is 16-bit (bf16/fp16), the forward keeps logits in that
// dtype for the backward instead of recomputing them (one GEMM of 2*n*V*D FLOPs saved per kept
// row n; 2.5 GB at T = 8192, V = 154880 in bf16): all [T, V] when they fit in `keep_bytes`
// (default kKeepLogitsMaxBytes), else the first whole chunks that fit, the rest recomputed
// (32k tokens: 3 of 8 chunks of 4096 at 4 GiB). On CUDA the backward then writes the logits'
// gradient over the kept logits and runs two GEMMs over all kept rows (the hidden's and the
// weight's gradient, fp32 accumulation inside the GEMM) instead of one pair per chunk
// accumulating into an fp32 [V, D] buffer; with every row kept the weight's gradient is rounded
// once by that GEMM (the bits of the whole-GEMM form).
// The per-chunk softmax work runs in kernels/logprobs.hpp (fused CUDA kernels for 16-bit CUDA
// logits, the LibTorch reference otherwise). With kernels::lm_head_fused_available (Hopper, bf16;
// on unless KILN_LM_HEAD_FUSED=0) the forward of token_logprobs instead takes each chunk's bf16
// probabilities against a per-row reference (the target's logit, one fp32 dot product, + 16) and
// its row sums from one GEMM (kernels/lm_head.hpp), the log-prob as that logit minus the lse;
// what is kept is then those probabilities, and the backward runs its two GEMMs straight from
// them, scaled by row (kernels::lm_head_probs_backward), with no pass over [n, V] between. A row
// with a gradient and a target log-prob below about -56 (its values past the GEMM's clamp) is
// recomputed there on its own (its fp32 logits, the default path's dz). A chunk not kept is made
// again in the backward by the same GEMM into one bf16 [chunk, V] scratch and goes through the
// same two GEMMs, the weight's gradient added in place into one fp32 [V, D]: what is not kept
// then costs one GEMM of 2*n*V*D FLOPs and no memory beyond that scratch and sum.
// Legend: T tokens, D hidden, V vocabulary.
#include <torch/torch.h>

namespace kiln::model {

inline constexpr int64_t kKeepLogitsMaxBytes = int64_t(4) << 30;

/// fp32 logits hidden_ND @ weight_VD^T -> [N, V]. On CUDA with 16-bit inputs one GEMM writes
/// fp32 directly (never rounded to bf16: a bf16 logit near 5 is only good to 0.03), so the
/// trainer and the rollout engine, which both use this, agree; elsewhere linear() then fp32.
torch::Tensor lm_logits(const torch::Tensor& hidden_ND, const torch::Tensor& weight_VD);

/// log softmax(hidden_TD @ weight_VD^T)[t, targets_T[t]], computed in fp32 per chunk of
/// `chunk` tokens; backward reuses the kept logits (at most keep_bytes of 16-bit [n, V], above)
/// and recomputes the other chunks'. Targets < 0 mark positions with no target: their
/// log-prob is 0 and they get no gradient.
/// hidden_TD: [T, D], weight_VD: [V, D] (same dtype), targets_T: [T] int64 -> [T] fp32.
/// Reference: equals torch.log_softmax(hidden @ weight.T, -1).gather(...) (tested).
torch::Tensor token_logprobs(const torch::Tensor& hidden_TD, const torch::Tensor& weight_VD,
                             const torch::Tensor& targets_T, int64_t chunk = 1024,
                             int64_t keep_bytes = kKeepLogitsMaxBytes);

/// As token_logprobs, plus the per-token entropy -sum_v p_v log p_v of the same distribution,
/// also differentiable (dH/dz_v = -p_v (z_v - E_p[z]), z the fp32 logits). -> ([T], [T]) fp32.
std::pair<torch::Tensor, torch::Tensor> token_logprobs_and_entropy(const torch::Tensor& hidden_TD,
                                                                   const torch::Tensor& weight_VD,
                                                                   const torch::Tensor& targets_T, int64_t chunk = 1024,
                                                                   int64_t keep_bytes = kKeepLogitsMaxBytes);

/// The true on-policy mode's output head (CausalLM::set_batch_invariant), written once for the
/// rollout sampler (actors/rollout/sampling.hpp) and the trainer: a token's log-prob has the
/// same bits on both sides. Logits: kernels::bi_linear(hidden_ND, weight_VD) in fp32 -> [N, V]
/// (no autograd). hidden and weight: same dtype (fp32/bf16).
torch::Tensor invariant_lm_logits(const torch::Tensor& hidden_ND, const torch::Tensor& weight_VD);
/// The tempered log-softmax's pieces: z = logits / temperature (fp32, elementwise per row),
/// lse = kernels::bi_logsumexp(z), so that log p(v) = z[v] - lse. logits_MV [M, V] fp32,
/// temperature_M [M] fp32 (> 0) -> z [M, V], lse [M] fp32. No autograd.
struct TemperedLogits {
  torch::Tensor z, lse;
};
TemperedLogits invariant_tempered_logits(const torch::Tensor& logits_MV, const torch::Tensor& temperature_M);
/// token_logprobs in the true on-policy mode: log p(target) = z[target] - lse of
/// invariant_tempered_logits(invariant_lm_logits(hidden, weight), temperature) per chunk of
/// `chunk` tokens (0 where target < 0). hidden_TD [T, D], weight_VD [V, D] (same dtype),
/// targets_T [T] int64 -> [T] fp32. Differentiable in hidden and weight with the gradients of
/// token_logprobs(hidden / temperature, ...) (recomputed in the backward: invariant_forward).
torch::Tensor token_logprobs_invariant(const torch::Tensor& hidden_TD, const torch::Tensor& weight_VD,
                                       const torch::Tensor& targets_T, double temperature, int64_t chunk = 1024);

/// Next-token targets of a packed batch: targets[t] = input_ids[t+1] when t+1 is in the same
/// document, else -1 (the last token of each document predicts nothing, never the next
/// document's first token). input_ids: [T], cu_seqlens: [B+1] -> [T] int64.
torch::Tensor next_token_targets(const torch::Tensor& input_ids, const torch::Tensor& cu_seqlens);

}  // namespace kiln::model
