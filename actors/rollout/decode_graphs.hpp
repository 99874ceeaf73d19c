#pragma once
// CUDA graphs of the rollout engine's decode steps (EngineOptions::cuda_graphs): a step in which
// every sequence adds one token replays a graph of the model's decode forward
// (CausalLM::forward_decode) and its lm_head, captured once per (batch bucket, page bucket),
// instead of launching every op from the host. The step's inputs (token ids, positions, the
// sequences' page tables) are copied into the graph's static input tensors, its logits and
// routed experts read from its static outputs. With `sample` (EngineOptions::sampling_kernel) the
// graph ends with the batch's sampling (kernels::sample_rows over the logits, the rows' sampling
// parameters and token indices being inputs too): a step's one host read is then its [B, 3]
// tokens, log-probs and entropies.
//
// Buckets: a batch of B sequences runs in the graph of the next power of two >= B, its rows
// past B inert (token 0 at position 0 on the scratch page, a cache page no sequence holds: their
// cache writes land there and their outputs are dropped). Page tables are padded to the page
// bucket of the longest sequence's pages W: W itself up to 8, then W rounded up to a multiple of
// 2^(floor(log2 W) - 3) (eight buckets per octave: at most 12.5% more keys than W pages hold; the
// keys past a sequence's position are masked). Each (B bucket, W bucket) is captured at its
// first use; all graphs share one memory pool.
//
// Weights must be written in place (load_hf_tensors copies into the parameters; the collective
// weight sync writes into them): the graphs hold the parameters' device addresses. Every run
// checks that the model's parameters and buffers still sit where they did at construction and
// throws std::logic_error naming the first one that moved. The cache must not be reallocated
// while this object lives (the engine allocates it once).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/rollout/sampling.hpp"
#include "kernels/cuda_graph.hpp"
#include "model/causal_lm.hpp"

namespace kiln::rollout {

class DecodeGraphs {
 public:
  /// `model` on a CUDA device with has_device_decode(); `cache` its decode cache, whose page
  /// `scratch_page` no sequence ever holds; `page_size` tokens per page; `max_pages` the most
  /// pages one sequence holds; `sample`: the graphs sample the tokens too. Throws
  /// std::invalid_argument naming what does not hold.
  DecodeGraphs(model::CausalLM& model, model::DecodeCache& cache, int64_t page_size, int64_t scratch_page,
               int64_t max_pages, bool sample = false);

  struct Step {
    torch::Tensor logits;          ///< [B, V] fp32 on the device (lm_logits of the hidden states)
    torch::Tensor routed_experts;  ///< [B, L, K] int64 on the device
    /// With `sample`: [B, 3] fp64 on the device, per row the sampled token id, its log-prob and
    /// the entropy (kernels/sampling.hpp); undefined without.
    torch::Tensor sampled;
  };
  /// One decode step of B = ids.size() sequences: sequence b feeds token ids[b] at position
  /// positions[b] (its tokens already cached) and holds the pages *pages[b] (enough for
  /// positions[b] + 1 tokens). With `sample`, row b samples with params[b] and the token index
  /// steps[b] (sample_tokens' arguments; both B entries); without, both must be empty. The
  /// returned tensors are views of the graph's outputs: valid until the next run. Captures the
  /// bucket's graph first if it is new. Throws std::invalid_argument for inconsistent inputs,
  /// std::logic_error when a weight moved.
  Step run(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
           const std::vector<const std::vector<int64_t>*>& pages, const std::vector<const SamplingParams*>& params = {},
           const std::vector<int64_t>& steps = {});

  /// The batch bucket of B >= 1: the next power of two.
  static int64_t batch_bucket(int64_t batch);
  /// The page bucket of W >= 1 pages (see above), at most max(W, max_pages).
  static int64_t pages_bucket(int64_t pages, int64_t max_pages);
  int64_t captured() const { return int64_t(graphs_.size()); }
  int64_t replays() const { return replays_; }

 private:
  struct Graph {
    /// [Bb * (2 + Wb + 5)] int64, pinned host memory: ids, positions, table, and the rows'
    /// sampling parameters (write_sampling_rows; used with `sample`)
    torch::Tensor staging;
    torch::Tensor inputs;   ///< the same on the device; ids, positions and table are views of it
    torch::Tensor ids, positions, table, sampling;
    torch::Tensor logits, routed_experts, sampled;  ///< the captured outputs
    std::unique_ptr<kernels::CapturedGraph> graph;
  };
  Graph& graph_for(int64_t batch_bucket, int64_t pages_bucket);
  void check_weights() const;

  model::CausalLM& model_;
  model::DecodeCache& cache_;
  int64_t page_size_, scratch_page_, max_pages_;
  bool sample_;
  torch::Device device_;
  kernels::GraphPool pool_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Graph>> graphs_;
  struct Weight {
    std::string name;
    torch::Tensor tensor;  ///< the parameter or buffer itself
    const void* address;   ///< its data when the graphs were set up
  };
  std::vector<Weight> weights_;
  int64_t replays_ = 0;
};

}  // namespace kiln::rollout
