#include "actors/trainer/frozen_reference.hpp"

#include <stdexcept>

#include "model/registry.hpp"

namespace kiln::trainer {

FrozenReference::FrozenReference(const model::ModelSpec& spec, model::CausalLM& policy, const LogprobConfig& config)
    : model_(model::Registry::with_plugins().build(spec, policy.expert_slice())), config_(config) {
  model_->set_expert_parallel(policy.expert_parallel());  // a model built whole keeps this rank's slice
  torch::NoGradGuard no_grad;
  auto source = policy.named_parameters(/*recurse=*/true);
  const auto source_buffers = policy.named_buffers(/*recurse=*/true);
  for (const auto& b : source_buffers) source.insert(b.key(), b.value());
  auto copy = [&](const std::string& name, torch::Tensor& to) {
    const auto* from = source.find(name);
    if (!from || from->sizes() != to.sizes())
      throw std::invalid_argument("colocated reference: the policy has " +
                                  (from ? "shape " + c10::str(from->sizes()) : std::string("no tensor")) + " for '" +
                                  name + "', the reference built from model.* " + c10::str(to.sizes()));
    to.copy_(*from);
  };
  for (auto& p : model_->named_parameters(/*recurse=*/true)) {
    copy(p.key(), p.value());
    p.value().set_requires_grad(false);  // frozen: no gradient is ever kept for it
  }
  for (auto& b : model_->named_buffers(/*recurse=*/true)) copy(b.key(), b.value());
  model_->set_batch_invariant(config_.true_on_policy);
}

std::vector<std::vector<float>> FrozenReference::logprobs(const std::vector<Sample>& samples, bool routing_replay) const {
  auto c = config_;
  c.routing_replay &= routing_replay;
  return completion_logprobs(*model_, samples, c);
}

}  // namespace kiln::trainer
