#pragma once
// Fully sharded data parallel for the decoder layers (ZeRO stage 3, Rajbhandari et al. 2020,
// arXiv:1910.02054; the unit-by-layer form of PyTorch FSDP, Zhao et al. 2023, arXiv:2304.11277):
// during a training step each rank holds 1/W of every layer's parameters; a layer's whole
// parameters exist only while it runs (forward, and again for its backward), all-gathered just
// before, with the next layer's gather started while this one computes (prefetch, one layer
// ahead in both directions), and freed after. As a layer's backward ends, its gradients are
// reduce-scattered into the ranks' fp32 shards (started at once, finished after the last
// micro-batch), so the reductions overlap the remaining backward.
//
// The output head (the lm_head after the last layer; `head` of the constructor) may be one
// more unit, logical layer L: gathered while the last layer runs (its prefetch), waited for as
// that layer's forward ends, and its gradient's reduce-scatter started as the backward enters
// the last layer (the head's backward, the first of the step, has ended then), so that the
// largest dense tensor's reduction overlaps the layers' backward instead of following it.
//
// Between steps the layers are gathered whole again (gather_all(), after the optimizer step),
// so that whatever reads the policy outside a step (weight sync, checkpoints, the old-log-prob
// pass) sees it as a replicated trainer's; the memory saved is the step's: activations, the
// gradients and the parameters of all layers but the one or two in flight.
//
// Units: one per (decoder layer, parameter dtype) — a layer's parameters of one dtype laid out
// as ShardedAdamW lays out its flat index (legend there: N_u elements, S_u = ceil(N_u / W));
// the parameters are views of the unit's flat [W*S_u] buffer in their dtype (Tensor::set_data,
// as FSDP1's flat parameter), whose storage is freed (resized to 0 bytes) and allocated again
// around each use; the gather sends the masters rounded to that dtype ([S_u]), the values
// ShardedAdamW::gather_parameters would write. Each unit's masters and AdamW state are its
// own ShardedAdamW (fp32, sharded over the group).
//
// Autograd: before_layer wraps the layer's input in an identity node whose backward runs once
// the layer's whole backward has run (its gradients accumulated: every node of the layer was
// created after it and torch's engine runs the ready node with the highest sequence number
// first); after_layer wraps the output in one whose backward runs before any of the layer's.
// Parameters are leaves throughout: the gathers write their storage directly, so no version
// counter of a saved parameter changes.
#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "actors/trainer/sharded_adamw.hpp"
#include "model/causal_lm.hpp"
#include "parallel/group.hpp"

namespace kiln::trainer {

class FullyShardedLayers : public model::LayerHooks {
 public:
  /// One unit's parameters: their indices in the caller's parameter list and the tensors.
  struct UnitSpec {
    std::vector<std::size_t> index;
    std::vector<torch::Tensor> params;
  };
  /// `layers[l]`: decoder layer l's parameters to shard (index, tensor), in parameters() order;
  /// split into one unit per dtype. Collective over `group` (each unit's ShardedAdamW makes the
  /// parameters group rank 0's). The parameters stay whole (gathered) until reshard().
  /// `reshard_after_forward` (FSDP2's name): true frees each layer's parameters after its
  /// forward and gathers them again for its backward (ZeRO-3); false keeps every layer whole
  /// through the step (FSDP's SHARD_GRAD_OP, ZeRO-2: no gathers inside the step, only each
  /// layer's gradient reduce-scatter started as its backward ends, and the gather after the
  /// optimizer step). `head`: the output head's parameters (index, tensor), used only after the
  /// last decoder layer's output (e.g. the untied lm_head), sharded as one more unit (above);
  /// empty: none. `reduce_dtype`: each unit's gradient reduction (ShardedAdamW). Throws
  /// std::invalid_argument when `layers` is empty or a layer has no parameters.
  FullyShardedLayers(const std::vector<std::vector<std::pair<std::size_t, torch::Tensor>>>& layers,
                     parallel::Group& group, torch::optim::AdamWOptions options, bool reshard_after_forward = true,
                     const std::vector<std::pair<std::size_t, torch::Tensor>>& head = {},
                     torch::Dtype reduce_dtype = torch::kFloat32);

  torch::Tensor before_layer(int64_t layer, const torch::Tensor& x) override;
  torch::Tensor after_layer(int64_t layer, const torch::Tensor& x) override;

  /// Frees every layer's whole parameters: from here to gather_all() the layers are gathered
  /// one by one as forward() reaches them (with reshard_after_forward false they stay whole,
  /// and only the backward's reductions run per layer). Not collective.
  void reshard();
  /// Collective. Every layer all-gathered from its masters (after an optimizer step or a
  /// load of the masters); the hooks do nothing until the next reshard().
  void gather_all();
  /// Collective. The optimizer step, unit by unit, each unit's all-gather started as soon as
  /// its update is queued (the gather of unit u runs while unit u+1 updates); ends as
  /// gather_all() does, with every layer whole. ShardedAdamW::step of each unit at `lr`.
  void step_and_gather_all(double lr);
  /// Collective. Finishes every reduce-scatter the backward passes started since zero_grad()
  /// (ShardedAdamW::finish_reduce_gradients of each unit).
  void finish_reduce_gradients();

  std::size_t units() const { return units_.size(); }
  /// Units gathered for a layer's forward or backward so far (not gather_all's): what a step
  /// of m micro-batches over L layers costs, m * (2L - 1) per dtype (the last layer's
  /// parameters stay for its backward), plus m for a head unit.
  int64_t layer_gathers() const { return layer_gathers_; }
  /// Units whose gradients a layer's backward reduced so far: m * L per dtype for a step (plus
  /// m for a head unit).
  int64_t layer_reductions() const { return layer_reductions_; }
  ShardedAdamW& optimizer(std::size_t unit) { return *units_.at(unit).optimizer; }
  /// The caller's indices of unit `unit`'s parameters (UnitSpec::index).
  const std::vector<std::size_t>& index(std::size_t unit) const { return units_.at(unit).index; }

  /// Used by the autograd nodes: layer `layer`'s backward is about to start / has ended.
  void backward_starts(int64_t layer);
  void backward_ended(int64_t layer);

 private:
  struct Unit {
    std::vector<std::size_t> index;
    std::vector<torch::Tensor> params;
    std::unique_ptr<ShardedAdamW> optimizer;
    torch::Tensor full;  ///< [W*S] in the parameters' dtype; the parameters are views of it
    int64_t bytes = 0;   ///< full's bytes when allocated
    torch::Tensor low;   ///< [S]: the masters rounded to the dtype, the gather's input
    c10::intrusive_ptr<c10d::Work> gathering;
    bool whole = true;   ///< full holds the gathered parameters
  };
  void start_gather(Unit& u);
  void wait_gather(Unit& u);
  void release(Unit& u);
  void check_layer(int64_t layer, const char* where) const;
  void reduce_unit(Unit& u);
  /// Starts u's all-gather from its masters whatever it holds (after an update).
  void start_regather(Unit& u);

  parallel::Group& group_;
  std::vector<Unit> units_;
  std::vector<std::vector<std::size_t>> by_layer_;  ///< units of each layer (then the head's, if any)
  int64_t layers_ = 0;                               ///< decoder layers (L)
  bool head_ = false;                                ///< by_layer_[L] is the head
  bool sharded_ = false;                            ///< between reshard() and gather_all()
  bool reshard_after_forward_ = true;
  int64_t layer_gathers_ = 0, layer_reductions_ = 0;
};

}  // namespace kiln::trainer
