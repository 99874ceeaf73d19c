#include "actors/trainer/fully_sharded.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kiln::trainer {

namespace {

// The storage under `t` (and every tensor sharing it) without its bytes / with new ones: how
// FSDP frees and re-allocates a flat parameter (torch's untyped_storage().resize_).
void free_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t, int64_t bytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(std::size_t(bytes)));
  s->set_nbytes(std::size_t(bytes));
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

FullyShardedLayers* owner_of(AutogradContext* ctx) {
  return reinterpret_cast<FullyShardedLayers*>(ctx->saved_data["owner"].toInt());
}

// Identity on a layer's input (kEntry: its backward runs after the layer's whole backward) or
// output (!kEntry: its backward runs before any of the layer's).
template <bool kEntry>
class LayerBoundary : public torch::autograd::Function<LayerBoundary<kEntry>> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t owner, int64_t layer) {
    ctx->saved_data["owner"] = owner;
    ctx->saved_data["layer"] = layer;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const int64_t layer = ctx->saved_data["layer"].toInt();
    if (kEntry) owner_of(ctx)->backward_ended(layer);
    else owner_of(ctx)->backward_starts(layer);
    return {grad[0], torch::Tensor(), torch::Tensor()};
  }
};
using LayerEntry = LayerBoundary<true>;
using LayerExit = LayerBoundary<false>;

}  // namespace

FullyShardedLayers::FullyShardedLayers(const std::vector<std::vector<std::pair<std::size_t, torch::Tensor>>>& layers,
                                       parallel::Group& group, torch::optim::AdamWOptions options,
                                       bool reshard_after_forward,
                                       const std::vector<std::pair<std::size_t, torch::Tensor>>& head,
                                       torch::Dtype reduce_dtype)
    : group_(group), reshard_after_forward_(reshard_after_forward) {
  if (layers.empty()) throw std::invalid_argument("FullyShardedLayers: no decoder layers to shard");
  // One unit per dtype of a layer's parameters (of the head's, as logical layer L).
  auto add_layer = [&](const std::vector<std::pair<std::size_t, torch::Tensor>>& params) {
    by_layer_.emplace_back();
    std::vector<torch::Dtype> dtypes;  // in order of first appearance
    for (const auto& [i, p] : params)
      if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) dtypes.push_back(p.scalar_type());
    for (auto dtype : dtypes) {
      Unit u;
      for (const auto& [i, p] : params)
        if (p.scalar_type() == dtype) {
          u.index.push_back(i);
          u.params.push_back(p);
        }
      u.optimizer = std::make_unique<ShardedAdamW>(u.params, group_, options, reduce_dtype);  // collective
      const int64_t n = group_.size() * u.optimizer->shard_size();
      u.full = torch::zeros({n}, u.params.front().options().requires_grad(false));
      u.bytes = n * int64_t(u.full.element_size());
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        auto& p = u.params[k];
        auto view = u.full.narrow(0, u.optimizer->param_offset(k), p.numel()).view(p.sizes());
        view.copy_(p.detach());
        p.set_data(view);  // the parameter (still the same leaf) now lives in the unit's buffer
      }
      by_layer_.back().push_back(units_.size());
      units_.push_back(std::move(u));
    }
  };
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].empty())
      throw std::invalid_argument("FullyShardedLayers: decoder layer " + std::to_string(l) + " has no parameters");
    add_layer(layers[l]);
  }
  layers_ = int64_t(layers.size());
  if (!head.empty()) {
    add_layer(head);
    head_ = true;
  }
}

void FullyShardedLayers::check_layer(int64_t layer, const char* where) const {
  if (layer < 0 || layer >= layers_)
    throw std::invalid_argument(std::string("FullyShardedLayers::") + where + ": layer " + std::to_string(layer) +
                                " of a model sharded as " + std::to_string(layers_) + " layers");
}

void FullyShardedLayers::start_gather(Unit& u) {
  if (u.whole || u.gathering) return;
  allocate_storage(u.full, u.bytes);
  u.low = u.optimizer->master_shard().to(u.full.scalar_type());  // rounding is elementwise
  u.gathering = group_.start_all_gather_into_tensor(u.full, u.low);
  ++layer_gathers_;
}

void FullyShardedLayers::wait_gather(Unit& u) {
  if (u.whole) return;
  start_gather(u);
  group_.finish(u.gathering, "all_gather_into_tensor");
  u.gathering.reset();
  u.low = torch::Tensor();
  u.whole = true;
}

void FullyShardedLayers::release(Unit& u) {
  if (u.gathering) wait_gather(u);  // a prefetch nobody used (the backward ended early)
  if (!u.whole) return;
  free_storage(u.full);
  u.whole = false;
}

torch::Tensor FullyShardedLayers::before_layer(int64_t layer, const torch::Tensor& x) {
  if (!sharded_) return x;
  check_layer(layer, "before_layer");
  for (auto k : by_layer_[std::size_t(layer)]) wait_gather(units_[k]);  // (kept whole: nothing to wait for)
  if (layer + 1 < int64_t(by_layer_.size()))
    for (auto k : by_layer_[std::size_t(layer + 1)]) start_gather(units_[k]);  // prefetch
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return x;
  return LayerEntry::apply(x, reinterpret_cast<int64_t>(this), layer);
}

torch::Tensor FullyShardedLayers::after_layer(int64_t layer, const torch::Tensor& x) {
  if (!sharded_) return x;
  check_layer(layer, "after_layer");
  const bool last = layer + 1 == layers_;
  if (last && head_)  // the head runs next: its gather was this layer's prefetch
    for (auto k : by_layer_[std::size_t(layers_)]) wait_gather(units_[k]);
  const bool grad = torch::GradMode::is_enabled() && x.requires_grad();
  // Whole through the step: no gather for the backward, only the head's reduction to start.
  if (!reshard_after_forward_)
    return grad && last && head_ ? LayerExit::apply(x, reinterpret_cast<int64_t>(this), layer) : x;
  // The last layer's backward comes first: it keeps its parameters (FSDP's root does too).
  if (!grad || !last)
    for (auto k : by_layer_[std::size_t(layer)]) release(units_[k]);
  if (!grad) return x;
  return LayerExit::apply(x, reinterpret_cast<int64_t>(this), layer);
}

void FullyShardedLayers::backward_starts(int64_t layer) {
  check_layer(layer, "backward_starts");
  if (head_ && layer + 1 == layers_)  // the head's backward has ended: its gradient is whole
    for (auto k : by_layer_[std::size_t(layers_)]) reduce_unit(units_[k]);
  for (auto k : by_layer_[std::size_t(layer)]) wait_gather(units_[k]);
  if (layer > 0)
    for (auto k : by_layer_[std::size_t(layer - 1)]) start_gather(units_[k]);  // prefetch
}

void FullyShardedLayers::backward_ended(int64_t layer) {
  check_layer(layer, "backward_ended");
  for (auto k : by_layer_[std::size_t(layer)]) reduce_unit(units_[k]);
}

void FullyShardedLayers::reduce_unit(Unit& u) {
  u.optimizer->start_reduce_gradients();  // reads the gradients now
  ++layer_reductions_;
  for (auto& p : u.params) p.mutable_grad() = torch::Tensor();
  if (reshard_after_forward_) release(u);
}

void FullyShardedLayers::reshard() {
  if (reshard_after_forward_)
    for (auto& u : units_) release(u);
  sharded_ = true;
}

void FullyShardedLayers::start_regather(Unit& u) {
  if (u.gathering) wait_gather(u);
  u.whole = false;  // gathered again from the masters, whatever it held
  if (u.full.storage().nbytes() == 0) allocate_storage(u.full, u.bytes);
  u.low = u.optimizer->master_shard().to(u.full.scalar_type());
  u.gathering = group_.start_all_gather_into_tensor(u.full, u.low);
}

void FullyShardedLayers::gather_all() {
  for (auto& u : units_) start_regather(u);
  for (auto& u : units_) wait_gather(u);
  sharded_ = false;
}

void FullyShardedLayers::step_and_gather_all(double lr) {
  for (auto& u : units_) {
    u.optimizer->step(lr, /*gather=*/false);
    start_regather(u);  // queued behind this unit's update, beside the next unit's
  }
  for (auto& u : units_) wait_gather(u);
  sharded_ = false;
}

void FullyShardedLayers::finish_reduce_gradients() {
  for (auto& u : units_) u.optimizer->finish_reduce_gradients();
}

}  // namespace kiln::trainer
