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

/// Samples one token from logits [V] (any float dtype; computed in fp32).
SampledToken sample_token(const torch::Tensor& logits, const SamplingParams& params, at::Generator& generator);

/// A CPU generator seeded for one request.
at::Generator make_generator(uint64_t seed);

}  // namespace kiln::rollout
