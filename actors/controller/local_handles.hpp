#pragma once
// The actors in the controller's own process: the trainer (policy + AdamW), the in-process
// LibTorch engine, the reference model. Weight sync still runs over the messaging layer
// (inproc://: tensor frames are not copied), so one code path serves local and remote engines.
#include <memory>
#include <mutex>
#include <optional>

#include "actors/controller/handles.hpp"
#include "actors/rollout/engine.hpp"
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
  trainer::StepMetrics train(std::vector<trainer::Sample> samples) override;
  PolicyWeights weights(bool copy) override;
  void send(const PolicyWeights& w, const std::vector<std::string>& targets) override;
  torch::Device policy_device() const override { return policy_->lm_head_weight().device(); }
  void send_collective(weight_sync::CollectiveSender& sender) override;
  void save(const std::filesystem::path& dir, const trainer::CheckpointState& state) override;
  trainer::CheckpointState load(const std::filesystem::path& dir) override;

 private:
  std::shared_ptr<model::CausalLM> policy_;
  std::unique_ptr<trainer::Trainer> trainer_;
  messaging::Gateway& gw_;
  uint64_t bucket_bytes_;
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
