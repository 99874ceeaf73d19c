#pragma once
// CUDA graphs of the rollout engine's decode steps (EngineOptions::cuda_graphs): a step in which
// every sequence adds one token replays a graph of the model's decode forward
// (CausalLM::forward_decode) and its lm_head, captured once per (batch bucket, page bucket),
// instead of launching every op from the host. The step's inputs (token ids, positions, the
// sequences' page tables) are copied into the graph's static input tensors, its logits and
// routed experts read from its static outputs. With `sample` (EngineOptions::sampling_kernel) the
// graph ends with the batch's sampling (kernels::sample_rows over the logits, the rows' sampling
// parameters and token indices being inputs too): a step's one host read is then its [B, 3]
// tokens, log-probs and entropies. launch() queues such a step without waiting for it, its ids
// on the host or taken on the device from the previous launch's samples (SampledIds), and
// read() waits for its results: the engine queues step n + 1 before it reads step n's tokens
// (EngineOptions::overlap_schedule), so the host's work between steps hides behind the GPU's.
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
#include "kernels/stream_event.hpp"
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
  /// Waits for the last launched step (a step queued and never read, e.g. one whose rows all
  /// finished), so that no graph is destroyed while it runs.
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

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

  /// A step of graphs that sample, launched with launch() and not yet read: behind the graph its
  /// sampled rows and routed experts are copied into pinned host memory, and an event marks
  /// when they are there. Dropping one unread is safe (its copies land in memory the host
  /// allocator keeps until they did).
  struct Launched {
    int64_t rows = 0;              ///< B
    uint64_t serial = 0;           ///< which replay of this object it was (1, 2, ...; run() counts too)
    torch::Tensor sampled_device;  ///< [B, 3] fp64, a view of the graph's output: valid until it replays again
    torch::Tensor sampled_host;    ///< [B, 3] fp64, pinned
    torch::Tensor experts_host;    ///< [B, L, K] int64, pinned
    std::shared_ptr<kernels::StreamEvent> ready;
  };
  /// Token ids of a step taken on the device from the previous launch's samples, so that the
  /// step can be queued before the host has read them (the engine's overlapped decode): row b
  /// feeds the token sampled in row rows[b] of `from`.
  struct SampledIds {
    const Launched* from = nullptr;
    std::vector<int64_t> rows;
  };
  /// Queues one decode step (graphs that sample only) and returns without waiting for it:
  /// run()'s arguments, with the ids given on the host or as SampledIds of the last launch
  /// (std::invalid_argument for another launch or a row outside it). read() waits for it.
  Launched launch(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                  const std::vector<const std::vector<int64_t>*>& pages, const std::vector<const SamplingParams*>& params,
                  const std::vector<int64_t>& steps);
  Launched launch(const SampledIds& ids, const std::vector<int64_t>& positions,
                  const std::vector<const std::vector<int64_t>*>& pages, const std::vector<const SamplingParams*>& params,
                  const std::vector<int64_t>& steps);
  /// A launched step's results on the host, once it ran (blocks until then): per row the
  /// sampled token, its log-prob and entropy, and routed_experts [B, L, K] int64 (CPU, pinned).
  struct Read {
    std::vector<SampledToken> tokens;
    torch::Tensor routed_experts;
  };
  static Read read(const Launched& step);

  /// The batch bucket of B >= 1: the next power of two.
  static int64_t batch_bucket(int64_t batch);
  /// The page bucket of W >= 1 pages (see above), at most max(W, max_pages).
  static int64_t pages_bucket(int64_t pages, int64_t max_pages);
  int64_t captured() const { return int64_t(graphs_.size()); }
  int64_t replays() const { return replays_; }

 private:
  struct Graph {
    /// [Bb * (2 + Wb + 5 + 1)] int64 on the device: ids, positions, table, the rows' sampling
    /// parameters (write_sampling_rows; used with `sample`) and the rows of SampledIds (read
    /// outside the graph); the named tensors are views of it
    torch::Tensor inputs;
    torch::Tensor ids, positions, table, sampling, id_rows;
    torch::Tensor logits, routed_experts, sampled;  ///< the captured outputs
    std::unique_ptr<kernels::CapturedGraph> graph;
  };
  Graph& graph_for(int64_t batch_bucket, int64_t pages_bucket);
  /// Checks a step's inputs, picks (captures) its graph and queues the copy of its inputs from
  /// fresh pinned memory (host_ids, or the ids of `from` when host_ids is null).
  Graph& stage(const std::vector<int64_t>* host_ids, const SampledIds* from, const std::vector<int64_t>& positions,
               const std::vector<const std::vector<int64_t>*>& pages, const std::vector<const SamplingParams*>& params,
               const std::vector<int64_t>& steps);
  /// Replays g for B rows and queues the copies of its samples and routed experts to the host.
  Launched queue(Graph& g, int64_t B);
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
  uint64_t launches_ = 0;  // replays so far by launch() and run(): a Launched's serial
  std::shared_ptr<kernels::StreamEvent> last_ready_;  // the last launch()'s event
};

}  // namespace kiln::rollout
