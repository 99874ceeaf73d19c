#pragma once
// The rollout backend interface the rollout actor drives. The in-process LibTorch Engine
// (engine.hpp) is the first implementation; a `kiln serve` process or an HTTP server can be
// others. A backend is driven from one thread: submit requests, call step() until they are
// done (or generate() for a blocking batch). Weight updates happen between steps: pause(),
// update_weights(), resume(); a paused backend's step() does nothing.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "actors/rollout/sampling.hpp"
#include "messaging/tensor.hpp"

namespace kiln::rollout {

struct GenerationRequest {
  uint64_t id = 0;
  std::vector<int64_t> prompt;  ///< token ids, at least one
  SamplingParams sampling;
};

enum class FinishReason { stop, length };
const char* to_string(FinishReason r);

/// A finished sample. Legend: P prompt tokens, n generated tokens, L MoE layers, K top-k.
struct Completion {
  uint64_t id = 0;
  std::vector<int64_t> prompt;
  std::vector<int64_t> tokens;           ///< [n] generated ids, the stop token included
  std::vector<float> logprobs;           ///< [n] behaviour log-probs (sampling.hpp convention)
  std::vector<float> entropies;          ///< [n]
  std::vector<int64_t> policy_versions;  ///< [n] weights version that produced each token
  /// [P + n - 1, L, K] int64: experts used at each position fed through the model (every
  /// prompt token and every generated token but the last, which is never fed). Row order
  /// is the sequence order, ids by descending biased score, as the packed forward returns.
  torch::Tensor routed_experts;
  /// [P + n - 1, Ls, W] int64, the same rows: each sparse-attention layer's selected key
  /// positions (models with an indexer, e.g. glm5_next; -1 for none), undefined otherwise.
  torch::Tensor topk_indices;
  FinishReason finish_reason = FinishReason::length;
  double time_to_first_token_s = 0;      ///< submit -> first token, seconds
};

class RolloutBackend {
 public:
  virtual ~RolloutBackend() = default;
  /// Queues a request. Throws std::invalid_argument for an empty prompt, bad sampling
  /// parameters, or a request that could never fit the cache.
  virtual void submit(GenerationRequest request) = 0;
  /// One scheduling step (admit, prefill, decode one token each); returns what finished.
  virtual std::vector<Completion> step() = 0;
  /// Submits all and steps until every one is done (completion order = finish order).
  virtual std::vector<Completion> generate(std::vector<GenerationRequest> requests) = 0;
  virtual bool has_work() const = 0;
  virtual void pause() = 0;
  virtual void resume() = 0;
  virtual bool paused() const = 0;
  /// Loads HF-named weights and sets the policy version stamped on later tokens. Allowed
  /// only while paused (throws std::logic_error otherwise); sequences in flight continue with
  /// the new weights after resume().
  virtual void update_weights(const std::vector<messaging::Tensor>& hf_tensors, int64_t version) = 0;
  virtual int64_t policy_version() const = 0;
};

}  // namespace kiln::rollout
