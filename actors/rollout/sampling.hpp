#pragma once
// Token sampling for rollouts.
//
// Log-prob convention (the trainer must use the same): the behaviour log-prob of a sampled
// token is taken from the *tempered, untruncated* distribution, log_softmax(logits / T)[token];
// top-k / top-p only restrict which tokens can be drawn. Entropy is that of the same tempered
// distribution. Temperature 0 means greedy; its log-prob and entropy use T = 1.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace kiln::rollout {

/// Where the sampler reads a smaller top_p as this one. A top_p at or under the top token's
/// probability (>= 1 / V >= 2.4e-7 for kiln's vocabularies) keeps the top token alone, so this
/// changes no nucleus; a top_p of 1e-300 was 0 in fp32 and kept nothing, failing the step of
/// every request in the batch.
inline constexpr double kTopPFloor = 1e-30;

struct SamplingParams {
  double temperature = 1.0;  ///< 0 = greedy
  int64_t top_k = 0;         ///< 0 = off
  double top_p = 1.0;        ///< 1 = off; below kTopPFloor sampled as kTopPFloor (the same nucleus: the top token)
  uint64_t seed = 0;         ///< per request: the same seed gives the same samples
  int64_t max_new_tokens = 64;
  std::vector<int64_t> stop_token_ids;               ///< any of these ends the sample (kept)
  std::vector<std::vector<int64_t>> stop_sequences;  ///< a completion ending with one stops (kept)
  /// Throws std::invalid_argument naming the field (a temperature neither 0 nor >=
  /// model::kMinTemperature, top_p outside (0, 1], negative top_k, max_new_tokens < 1).
  void validate() const;
};

struct SampledToken {
  int64_t token = 0;
  float logprob = 0;  ///< log_softmax(logits / T)[token] (T = 1 when greedy)
  float entropy = 0;  ///< of the same distribution, nats
};

/// Samples one token per row from logits [B, V] (any float dtype and device; computed in fp32
/// where the logits live, one host read for the whole batch): row b uses params[b] and the
/// uniform u = kernels::philox_uniform(params[b]->seed, steps[b]), steps[b] being the index of
/// the token in its request's completion (0 for the first): a request's draws depend on its seed
/// and on nothing else (not on its neighbours in the batch, nor on the device). Greedy rows take
/// the arg-max; others filter (top-k, then top-p over the tempered distribution) and take the
/// first token whose cumulative probability exceeds u * total (inverse CDF); kernels/sampling.hpp
/// says it exactly. logprob and entropy are of the untruncated log_softmax(logits / T).
/// `kernel`: fp32 logits on CUDA run the one-kernel sampler (kernels::sample_rows); false, or
/// other logits: the LibTorch reference (kernels::sample_rows_ref). The two draw the same token
/// but where cumulative sums round differently at a token boundary. Throws
/// std::invalid_argument when params or steps do not have B entries.
/// batch_invariant (the true on-policy mode; logits fp32 from model::invariant_lm_logits): the
/// sampled token's logprob is z[token] - lse of model::invariant_tempered_logits, the formula
/// the trainer's head uses, so that it has the same bits in any batch and in the trainer (the
/// token drawn and the entropy are the sampler's, row by row). Throws std::invalid_argument for
/// logits of another dtype then.
std::vector<SampledToken> sample_tokens(const torch::Tensor& logits_BV, const std::vector<const SamplingParams*>& params,
                                        const std::vector<int64_t>& steps, bool kernel = true,
                                        bool batch_invariant = false);
/// One row: sample_tokens with B = 1. logits: [V].
SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& params, int64_t step);

/// The rows' sampling parameters as kernels::sample_rows takes them, written into `five` [5, B]
/// int64 (host memory): temperature and top_p as the bits of fp64 values, top_k, seed, step.
void write_sampling_rows(const std::vector<const SamplingParams*>& params, const std::vector<int64_t>& steps,
                         int64_t* five, int64_t B);
/// Views of such a [5 * B] int64 tensor as sample_rows' five arguments: temperature [B] fp64,
/// top_k [B] int64, top_p [B] fp64, seed [B] int64, step [B] int64.
struct SamplingRows {
  torch::Tensor temperature, top_k, top_p, seed, step;
  explicit SamplingRows(const torch::Tensor& five_B);
  /// kernels::sample_rows of logits [B, V] fp32 with these rows -> [B, 3] fp64 (token, logprob, entropy).
  torch::Tensor sample(const torch::Tensor& logits_BV, bool kernel = true) const;
};

/// The SampledTokens of sample_rows' [B, 3] fp64 output, read on the host.
std::vector<SampledToken> sampled_tokens(const torch::Tensor& out_B3);

}  // namespace kiln::rollout
