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
                                       bool reshard_after_forward)
    : group_(group), reshard_after_forward_(reshard_after_forward) {
  if (layers.empty()) throw std::invalid_argument("FullyShardedLayers: no decoder layers to shard");
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].empty())
      throw std::invalid_argument("FullyShardedLayers: decoder layer " + std::to_string(l) + " has no parameters");
    by_layer_.emplace_back();
    std::vector<torch::Dtype> dtypes;  // in order of first appearance
    for (const auto& [i, p] : layers[l])
      if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) dtypes.push_back(p.scalar_type());
    for (auto dtype : dtypes) {
      Unit u;
      for (const auto& [i, p] : layers[l])
        if (p.scalar_type() == dtype) {
          u.index.push_back(i);
          u.params.push_back(p);
        }
      u.optimizer = std::make_unique<ShardedAdamW>(u.params, group_, options);  // collective
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
  }
}

void FullyShardedLayers::check_layer(int64_t layer, const char* where) const {
  if (layer < 0 || layer >= int64_t(by_layer_.size()))
    throw std::invalid_argument(std::string("FullyShardedLayers::") + where + ": layer " + std::to_string(layer) +
                                " of a model sharded as " + std::to_string(by_layer_.size()) + " layers");
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
  if (!reshard_after_forward_) return x;  // whole through the step: no gather for the backward
  const bool grad = torch::GradMode::is_enabled() && x.requires_grad();
  // The last layer's backward comes first: it keeps its parameters (FSDP's root does too).
  if (!grad || layer + 1 < int64_t(by_layer_.size()))
    for (auto k : by_layer_[std::size_t(layer)]) release(units_[k]);
  if (!grad) return x;
  return LayerExit::apply(x, reinterpret_cast<int64_t>(this), layer);
}

void FullyShardedLayers::backward_starts(int64_t layer) {
  check_layer(layer, "backward_starts");
  for (auto k : by_layer_[std::size_t(layer)]) wait_gather(units_[k]);
  if (layer > 0)
    for (auto k : by_layer_[std::size_t(layer - 1)]) start_gather(units_[k]);  // prefetch
}

void FullyShardedLayers::backward_ended(int64_t layer) {
  check_layer(layer, "backward_ended");
  for (auto k : by_layer_[std::size_t(layer)]) {
    auto& u = units_[k];
    u.optimizer->start_reduce_gradients();  // reads the gradients now
    ++layer_reductions_;
    for (auto& p : u.params) p.mutable_grad() = torch::Tensor();
    if (reshard_after_forward_) release(u);
  }
}

void FullyShardedLayers::reshard() {
  if (reshard_after_forward_)
    for (auto& u : units_) release(u);
  sharded_ = true;
}

void FullyShardedLayers::gather_all() {
  for (auto& u : units_) {
    if (u.gathering) wait_gather(u);
    u.whole = false;  // gathered again from the masters, whatever it held
    if (u.full.storage().nbytes() == 0) allocate_storage(u.full, u.bytes);
    u.low = u.optimizer->master_shard().to(u.full.scalar_type());
    u.gathering = group_.start_all_gather_into_tensor(u.full, u.low);
  }
  for (auto& u : units_) wait_gather(u);
  sharded_ = false;
}

void FullyShardedLayers::finish_reduce_gradients() {
  for (auto& u : units_) u.optimizer->finish_reduce_gradients();
}

}  // namespace kiln::trainer
