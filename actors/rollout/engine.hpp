#pragma once
// The in-process LibTorch rollout engine: prefill of packed prompts and incremental decoding
// against a paged cache of MLA's compressed latents (kv_lora_rank + qk_rope_head_dim values
// per token and layer), continuous batching (requests join while others decode; finished ones
// free their pages), and a hard bound on cache memory: a request is admitted only when pages
// for its prompt plus max_new_tokens are free, otherwise it waits in FIFO order.
#include <chrono>
#include <deque>
#include <memory>

#include "actors/rollout/backend.hpp"
#include "actors/rollout/engine_options.hpp"
#include "model/causal_lm.hpp"

namespace kiln::rollout {

/// Bytes of an engine's cache for `m` in `dtype`: cache_blocks * block_size * layers *
/// cache_width * dtype size.
int64_t cache_bytes(const EngineOptions& o, const model::CausalLM& m, torch::Dtype dtype);


class Engine : public RolloutBackend {
 public:
  /// The cache is allocated here, on the model's device, in the model's dtype.
  Engine(std::shared_ptr<model::CausalLM> model, EngineOptions options);
  void submit(GenerationRequest request) override;
  /// What submit() checks first: a prompt of ids in the vocabulary, valid sampling parameters
  /// (SamplingParams::validate), prompt + max_new_tokens within the whole cache. Throws
  /// std::invalid_argument naming the request and the fault. Reads only settings fixed at
  /// construction: callable from any thread.
  void check(const GenerationRequest& request) const;
  std::vector<Completion> step() override;
  std::vector<Completion> generate(std::vector<GenerationRequest> requests) override;
  bool has_work() const override { return !waiting_.empty() || !running_.empty(); }
  void pause() override { paused_ = true; }
  void resume() override { paused_ = false; }
  bool paused() const override { return paused_; }
  void update_weights(const std::vector<messaging::Tensor>& hf_tensors, int64_t version) override;
  int64_t policy_version() const override { return version_; }
  /// The model's weights were written in place (collective weight sync,
  /// weight_sync/collective.hpp): the engine now holds `version`. Between decode steps only:
  /// throws std::logic_error unless paused.
  void weights_written(int64_t version);
  /// Drops request `id` (waiting or running; a client that went away): its cache pages are
  /// free again and it never finishes. Returns whether it was there. Between steps only.
  bool cancel(uint64_t id);

  /// The tokens (and their log-probs, entropies, versions) request `id` has generated so far,
  /// while it runs; nullptr when it waits or is unknown. Between steps only.
  const Completion* progress(uint64_t id) const;
  int64_t free_blocks() const { return int64_t(free_.size()); }
  const EngineOptions& options() const { return o_; }
  std::size_t waiting() const { return waiting_.size(); }
  std::size_t running() const { return running_.size(); }

 private:
  struct Sequence {
    GenerationRequest request;
    std::vector<int64_t> blocks;
    at::Generator generator;
    Completion out;
    std::vector<torch::Tensor> expert_rows;  // [rows, L, K] pieces
    int64_t cached = 0;                      // tokens whose latents are in the cache
    std::chrono::steady_clock::time_point submitted;
  };
  bool finished(Sequence& s) const;

  std::shared_ptr<model::CausalLM> model_;
  EngineOptions o_;
  int64_t vocab_size_;
  std::vector<torch::Tensor> caches_;  // per layer [blocks, block_size, width]
  std::vector<int64_t> free_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  bool paused_ = false;
  int64_t version_ = 0;
};

/// Reference generation without a cache: every step packs all unfinished sequences (prompt +
/// tokens so far) into one batch and runs the full packed forward. Same sampling and seeds as
/// Engine; used for equivalence tests and as the benchmark baseline. Completions in request
/// order.
std::vector<Completion> generate_without_cache(model::CausalLM& model, const std::vector<GenerationRequest>& requests,
                                               int64_t version = 0);

}  // namespace kiln::rollout
