#pragma once
// The in-process LibTorch rollout engine: prefill of packed prompts and incremental decoding
// against the model's decode cache (model/decode_cache.hpp: the engine hands out its pages of
// block_size token positions and its max_batch slots; what they hold is the model's, e.g. MLA's
// compressed latents per token and layer, or per-sequence recurrent states), continuous batching (requests join while others decode; finished ones
// free their pages), and a hard bound on cache memory: a request is admitted only when pages
// for its prompt plus max_new_tokens are free, otherwise it waits in FIFO order.
//
// Shared prompts (EngineOptions::share_prompts, SGLang's and vLLM's prefix caching for the
// case RL needs: the n samples of a GRPO group): a request whose prompt equals that of a
// sequence prefilled at the current weights version (in this step's prefill or running) is
// not prefilled. It takes that sequence's full prompt pages by reference (pages are
// reference-counted, freed when the last holder finishes), copies the partial last page into
// a page of its own before its first decode (copy-on-write: decoding writes only positions
// >= P), reuses the prompt's routed experts and the hidden state of its last token, and
// samples its first token from those logits with its own seed: its output equals the
// unshared run's with the same seed. With a cache whose slots hold state (a recurrent state
// that advances with every token), only a sequence prefilled in the same step shares its
// prompt: its slot is copied right after that prefill.
//
// Overlap schedule (EngineOptions::overlap_schedule, with cuda_graphs and sampling_kernel): a
// graphed decode step() may return with the next decode step already queued on the GPU (its ids
// taken there from the step's samples); the next step() reads it. Between-steps calls see the
// tokens read so far; pause() waits for a queued step and drops it (run again after resume()).
#include <chrono>
#include <deque>
#include <memory>
#include <optional>

#include "actors/rollout/backend.hpp"
#include "actors/rollout/decode_graphs.hpp"
#include "actors/rollout/engine_options.hpp"
#include "model/causal_lm.hpp"

namespace kiln::rollout {

/// How many sequences an engine decodes at once: max_batch, but no more than cache_blocks (each
/// sequence holds a page of its own; a larger max_batch only sized per-sequence buffers past any
/// use, and rollout.max_batch = 2^63 - 1 ran the host out of memory filling them).
int64_t decode_slots(const EngineOptions& o);

/// Bytes of an engine's cache for `m` in `dtype` (CausalLM::decode_cache_bytes of cache_blocks
/// pages of block_size tokens and decode_slots(o) slots; one page more with cuda_graphs).
int64_t cache_bytes(const EngineOptions& o, const model::CausalLM& m, torch::Dtype dtype);


class Engine : public RolloutBackend {
 public:
  /// The cache is allocated here, on the model's device, in the model's dtype. Sets the model's
  /// batch-invariant mode to options.true_on_policy (CausalLM::set_batch_invariant). Throws
  /// std::invalid_argument for options out of range, cuda_graphs without absorbed_decode, and
  /// true_on_policy with absorbed_decode or cuda_graphs or a model without a batch-invariant
  /// forward, and cuda_graphs with an expert-parallel model (CausalLM::expert_parallel).
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
  /// With a decode step queued ahead (overlap_schedule), waits for it and drops it unread: its
  /// sequences run it again after resume(), at the weights they then hold.
  void pause() override;
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
  /// Prompt tokens run through prefill so far, and prompts shared instead (not prefilled).
  int64_t prefilled_tokens() const { return prefilled_tokens_; }
  int64_t shared_prompts() const { return shared_prompts_; }
  const EngineOptions& options() const { return o_; }
  /// Decode steps run by replaying a CUDA graph (cuda_graphs), and graphs captured so far.
  int64_t graph_steps() const { return graphs_ ? graphs_->replays() : 0; }
  int64_t graphs_captured() const { return graphs_ ? graphs_->captured() : 0; }
  /// Decode steps queued before the previous step's tokens were read (overlap_schedule).
  int64_t overlapped_steps() const { return overlapped_steps_; }
  /// Forwards of the model run so far (prefill or decode, eager or a graph launched): a step()
  /// runs at most one; one that ran none (nothing admitted, only shared prompts taken) leaves it.
  int64_t forwards() const { return forwards_; }
  /// The model the engine runs (the one given to the constructor).
  model::CausalLM& model() const { return *model_; }
  std::size_t waiting() const { return waiting_.size(); }
  std::size_t running() const { return running_.size(); }

 private:
  /// int64 rows [rows, A, W] appended on the host one decode step at a time (a sequence's routed
  /// experts [., L, K] or sparse-attention top-k indices [., Ls, W]): a step costs a copy of its
  /// values, not a tensor per sequence; after() joins them to the prompt's rows at the end.
  struct HostRows {
    std::vector<int64_t> values;
    int64_t rows = 0, a = 0, w = 0;
    /// Rows [start, start + count) of a contiguous [T, A, W] int64 CPU tensor; std::logic_error
    /// when A or W differ from the first piece's.
    void append(const torch::Tensor& t, int64_t start, int64_t count);
    /// `prompt` [P, A, W] followed by these rows: [P + rows, A, W] int64, a new tensor.
    torch::Tensor after(const torch::Tensor& prompt) const;
  };
  struct Sequence {
    GenerationRequest request;
    std::vector<int64_t> blocks;
    Completion out;
    HostRows decode_experts, decode_topk;  // the rows after the prompt's, one per decode step
    int64_t cached = 0;                    // tokens whose latents are in the cache
    std::chrono::steady_clock::time_point submitted;
    // After its prompt went through the model (prefill or shared): the version of the weights
    // that did it (-1: not yet), the hidden state of the last prompt token [D] and the
    // prompt's routed experts [P, L, K].
    int64_t prompt_version = -1;
    torch::Tensor prompt_hidden, prompt_experts, prompt_topk;  // prompt_topk: models with sparse-attention layers
    int64_t slot = -1;                     // its slot of the decode cache while it runs
  };
  /// A graphed decode step queued on the device and not yet read (overlap_schedule): row b
  /// is rows[b]'s next token, nullptr once that sequence finished or was cancelled.
  struct InFlight {
    DecodeGraphs::Launched step;
    std::vector<Sequence*> rows;
  };
  /// Queues the graphed decode step of `batch` (each sequence's last token, on the host) and
  /// reads it through advance().
  std::vector<Completion> launch_and_advance(const std::vector<Sequence*>& batch);
  /// Queues the step after in_flight_ when it is a pure decode step too (no request waiting,
  /// a row not ending at max_new_tokens), its ids from in_flight_'s samples on the device; then
  /// reads in_flight_, records its tokens and returns the sequences that finished.
  std::vector<Completion> advance();
  /// Moves the running sequences that finished out of running_ (their pages freed, their rows
  /// of in_flight_ dropped) into completions.
  std::vector<Completion> take_finished();
  bool finished(Sequence& s) const;
  /// A sequence of running_ or `admitted` whose prompt equals s's and went (or goes, this
  /// step) through the model at the current version; nullptr when none.
  Sequence* prompt_holder(const Sequence& s, const std::vector<std::unique_ptr<Sequence>>& admitted) const;
  void release(Sequence& s);  ///< its slot, and its pages, each freed when no other sequence holds it
  /// Moves waiting requests (FIFO) into `admitted` while pages, batch slots and the prefill
  /// budget allow, giving each its pages and slot; one whose prompt a running or admitted
  /// sequence holds (prompt_holder) takes that one's full prompt pages by reference and goes
  /// into `sharing` as (it, its holder) instead of through the model.
  void admit(std::vector<std::unique_ptr<Sequence>>& admitted, std::vector<std::pair<Sequence*, Sequence*>>& sharing);
  /// s takes holder's prefilled prompt: the partial last page copied (copy-on-write), the
  /// decode-cache slot's state, the last prompt token's hidden state and routing; s counts as
  /// having its prompt cached.
  void take_shared_prompt(Sequence& s, const Sequence& holder);

  std::shared_ptr<model::CausalLM> model_;
  EngineOptions o_;
  int64_t vocab_size_;
  std::unique_ptr<model::DecodeCache> cache_;  // the model's, cache_blocks pages (+1 with graphs) and max_batch slots
  std::unique_ptr<DecodeGraphs> graphs_;       // cuda_graphs: over cache_, scratch page cache_blocks
  std::vector<int64_t> free_, free_slots_;
  std::vector<int32_t> refs_;  // per page: sequences holding it
  int64_t prefilled_tokens_ = 0, shared_prompts_ = 0, overlapped_steps_ = 0, forwards_ = 0;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::optional<InFlight> in_flight_;
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
