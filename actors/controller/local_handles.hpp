#pragma once
// The actors in the controller's own process: the trainer (policy + AdamW), the in-process
// LibTorch engine, the reference model. Weight sync still runs over the messaging layer
// (inproc://: tensor frames are not copied), so one code path serves local and remote engines.
#include <memory>
#include <mutex>
#include <optional>

#include "actors/controller/handles.hpp"
#include "actors/rollout/engine.hpp"
#include "actors/rollout/lockstep.hpp"
#include "actors/trainer/frozen_reference.hpp"
#include "actors/weight_sync/service.hpp"
#include "messaging/gateway.hpp"
#include "model/causal_lm.hpp"

namespace kiln::controller {

class LocalTrainer : public TrainerHandle {
 public:
  /// `gateway`: where weights are sent from; `bucket_bytes`: weight-sync bucket size;
  /// `ranks`: trainer rank 0's process groups (trainer_ranks.hpp), or none (one rank).
  LocalTrainer(std::shared_ptr<model::CausalLM> policy, const trainer::TrainerConfig& config,
               messaging::Gateway& gateway, uint64_t bucket_bytes, parallel::ProcessGroups* ranks = nullptr);
  int64_t version() const override { return trainer_->version(); }
  int64_t vocab_size() const override { return policy_->vocab_size(); }
  RoutingShape routing_shape() const override {
    return {policy_->num_moe_layers(), policy_->experts_per_token(), policy_->num_experts()};
  }
  trainer::StepMetrics train(std::vector<trainer::Sample> samples) override;
  PolicyWeights weights(bool copy) override;
  void send(const PolicyWeights& w, const std::vector<std::string>& targets) override;
  torch::Device policy_device() const override { return policy_->lm_head_weight().device(); }
  void send_collective(weight_sync::CollectiveSender& sender) override;
  void save(const std::filesystem::path& dir, const trainer::CheckpointState& state) override;
  trainer::CheckpointState load(const std::filesystem::path& dir) override;
  /// This process's engine over the policy (with expert parallel: in lockstep with the ep
  /// group's other ranks, which the caller has asked to generate their shares).
  std::vector<rollout::Completion> generate_colocated(std::vector<rollout::GenerationRequest> requests,
                                                      const rollout::EngineOptions& engine, int64_t group_size,
                                                      const std::function<void()>& between_steps) override;
  /// Keeps the frozen reference from now on (trainer::FrozenReference of `spec`, the policy's
  /// current weights): before the first step and any checkpoint load.
  void hold_reference(const model::ModelSpec& spec);
  /// The reference's log-probs of `completions` in this process (with expert parallel: in
  /// step with the ep group's other ranks, which the caller has asked for their shares).
  std::vector<std::vector<float>> reference_logprobs(const std::vector<rollout::Completion>& completions) override;
  /// Whether placement.reference = "colocated" is in force here (hold_reference was called).
  bool holds_reference() const { return reference_ != nullptr; }

 private:
  std::shared_ptr<model::CausalLM> policy_;
  std::unique_ptr<trainer::Trainer> trainer_;
  messaging::Gateway& gw_;
  uint64_t bucket_bytes_;
  trainer::LogprobConfig logprobs_;  ///< the trainer's, for the reference
  std::unique_ptr<trainer::FrozenReference> reference_;
  std::unique_ptr<rollout::ColocatedEngine> engine_;  ///< generate_colocated's, built by the first
};

/// The in-process engine. It receives weights as actor weight_sync/0 on a gateway of its own
/// (routed from the controller's), verifies them, and loads them between decode steps.
class LocalEngine : public RolloutEngines {
 public:
  LocalEngine(std::shared_ptr<model::CausalLM> model, const rollout::EngineOptions& options,
              messaging::Gateway& controller_gateway);
  ~LocalEngine() override;
  std::vector<rollout::Completion> generate(std::vector<rollout::GenerationRequest> requests,
                                            const std::function<void()>& between_steps) override;
  void load(const PolicyWeights& w, TrainerHandle& trainer) override;

 private:
  rollout::Engine engine_;
  messaging::Gateway gw_;
  std::shared_ptr<weight_sync::ReceiverService> receiver_;
  std::mutex mu_;
  std::optional<std::pair<std::vector<messaging::Tensor>, int64_t>> received_;  // verified, not yet loaded
};

/// placement.mode = "colocated": the engines are the trainer's (TrainerHandle::generate_colocated),
/// over its own parameters, so new weights need no sync: load() only lets the versions pass.
class ColocatedEngines : public RolloutEngines {
 public:
  /// Builds every rank's engine now (a generation of no requests), so that engine settings
  /// are refused before the run starts; throws what rollout::Engine's constructor throws.
  ColocatedEngines(TrainerHandle& trainer, const rollout::EngineOptions& options, int64_t group_size)
      : trainer_(trainer), options_(options), group_size_(group_size) {
    trainer_.generate_colocated({}, options_, group_size_, [] {});
  }
  std::vector<rollout::Completion> generate(std::vector<rollout::GenerationRequest> requests,
                                            const std::function<void()>& between_steps) override {
    return trainer_.generate_colocated(std::move(requests), options_, group_size_, between_steps);
  }
  void load(const PolicyWeights&, TrainerHandle&) override {}  // the optimizer wrote them where the engines read
  bool needs_tensors() const override { return false; }

 private:
  TrainerHandle& trainer_;
  rollout::EngineOptions options_;
  int64_t group_size_;
};

/// placement.reference = "colocated": the frozen reference the trainer's ranks hold
/// (TrainerHandle::reference_logprobs).
class ColocatedReference : public ReferencePolicy {
 public:
  explicit ColocatedReference(TrainerHandle& trainer) : trainer_(trainer) {}
  std::vector<std::vector<float>> logprobs(const std::vector<rollout::Completion>& completions) override {
    return trainer_.reference_logprobs(completions);
  }

 private:
  TrainerHandle& trainer_;
};

/// The reference model in this process, loaded with the initial policy's weights.
class LocalReference : public ReferencePolicy {
 public:
  LocalReference(std::shared_ptr<model::CausalLM> model, const PolicyWeights& initial, trainer::LogprobConfig config);
  std::vector<std::vector<float>> logprobs(const std::vector<rollout::Completion>& completions) override;

 private:
  std::shared_ptr<model::CausalLM> model_;
  trainer::LogprobConfig config_;
};

}  // namespace kiln::controller
