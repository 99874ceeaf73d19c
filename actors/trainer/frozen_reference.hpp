#pragma once
// The frozen reference policy held by the trainer's own ranks (placement.reference =
// "colocated"): each rank keeps a second model of the policy's shape holding the policy's
// weights as they were when the run started, with expert parallel only this rank's experts
// (1/ep of them) where a reference actor holds the whole model on one device. Its log-probs
// are computed by every rank for its share of the completions, collectively over the ep group
// (completion_logprobs pads the ranks to the same number of forwards).
#include <memory>
#include <vector>

#include "actors/trainer/trainer.hpp"
#include "model/model_spec.hpp"

namespace kiln::trainer {

class FrozenReference {
 public:
  /// Builds spec's model (model::Registry; with the policy's expert slice, then expert parallel
  /// over the policy's ep group) and copies every parameter and buffer of `policy` into it by
  /// name: call it before the first step and before a checkpoint is loaded, so that it holds
  /// the run's initial weights. Sets the batch-invariant mode to config.true_on_policy (the
  /// policy's formula). Throws std::invalid_argument for a spec the registry refuses or a
  /// model whose names or shapes differ from the policy's.
  FrozenReference(const model::ModelSpec& spec, model::CausalLM& policy, const LogprobConfig& config);
  /// Per-token log-probs [samples][completion tokens] (completion_logprobs with the config
  /// given; routing replayed only when `routing_replay` and the config says so). Collective over
  /// the ep group: every rank calls it, with its own samples (none allowed).
  std::vector<std::vector<float>> logprobs(const std::vector<Sample>& samples, bool routing_replay) const;
  model::CausalLM& model() const { return *model_; }

 private:
  std::shared_ptr<model::CausalLM> model_;
  LogprobConfig config_;
};

}  // namespace kiln::trainer
