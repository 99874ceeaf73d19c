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

struct SamplingParams {
  double temperature = 1.0;  ///< 0 = greedy
  int64_t top_k = 0;         ///< 0 = off
  double top_p = 1.0;        ///< 1 = off
  uint64_t seed = 0;         ///< per request: the same seed gives the same samples
  int64_t max_new_tokens = 64;
  std::vector<int64_t> stop_token_ids;               ///< any of these ends the sample (kept)
  std::vector<std::vector<int64_t>> stop_sequences;  ///< a completion ending with one stops (kept)
  /// Throws std::invalid_argument naming the field (negative temperature, top_p outside
  /// (0, 1], negative top_k, max_new_tokens < 1).
  void validate() const;
};

struct SampledToken {
  int64_t token = 0;
  float logprob = 0;  ///< log_softmax(logits / T)[token] (T = 1 when greedy)
  float entropy = 0;  ///< of the same distribution, nats
};

/// Samples one token per row from logits [B, V] (any float dtype and device; computed in fp32
/// where the logits live, one host read for the whole batch). Row b uses params[b] and draws
/// one uniform u from generators[b] (a CPU generator: the same seed samples the same token on
/// any device): greedy rows take the arg-max; others filter (top-k, then top-p over the
/// tempered distribution) and take the first token whose cumulative probability exceeds
/// u * total (inverse CDF). logprob and entropy are of the untruncated log_softmax(logits / T).
/// batch_invariant (the true on-policy mode; logits fp32 from model::invariant_lm_logits):
/// log_softmax(logits / T) = z - lse of model::invariant_tempered_logits, the formula the
/// trainer's head uses, so that a token's logprob has the same bits in any batch and in the
/// trainer. Throws std::invalid_argument for logits of another dtype then.
std::vector<SampledToken> sample_tokens(const torch::Tensor& logits_BV, const std::vector<const SamplingParams*>& params,
                                        const std::vector<at::Generator*>& generators, bool batch_invariant = false);
/// One row: sample_tokens with B = 1. logits: [V].
SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator);

/// A CPU generator seeded for one request.
at::Generator make_generator(uint64_t seed);

}  // namespace kiln::rollout
