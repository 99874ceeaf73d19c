#pragma once
// Wire schema of the trainer family (trainer.*), spoken by the trainer actor
// (actors/trainer/trainer_service.hpp). docs/wire-format.md is the contract.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "messaging/schema.hpp"
#include "actors/rollout/messages.hpp"
#include "actors/trainer/trainer_config.hpp"
#include "model/model_spec.hpp"

namespace kiln::messaging {

/// The policy trainer in another process (actor trainer/N, answered with TrainerReady): builds
/// the policy as a one-process run does (torch::manual_seed(seed), then the registry), on
/// model.device in model.dtype, with the trainer settings.
struct TrainerInit {
  static constexpr std::string_view kType = "trainer.init";
  static constexpr uint32_t kVersion = 5;  ///< v3: trainer.logprobs.true_on_policy; v4: trainer.keep_logits_gib, activation_checkpointing_layers; v5: reference
  model::ModelSpec model;
  int64_t seed = 1;
  trainer::TrainerConfig trainer;
  double bucket_mib = 64;  ///< weight-sync bucket size for trainer.push_weights
  /// placement.reference = "colocated": the rank also keeps the frozen reference (a copy of its
  /// initial policy shard, trainer::FrozenReference) and answers ref.logprobs for its share
  bool reference = false;
  MSGPACK_DEFINE_MAP(model, seed, trainer, bucket_mib, reference);
};
/// Answer to trainer.init and trainer.load: the policy's version, vocabulary and routing (routing
/// replay's routed experts are [T, moe_layers, experts_per_token] ids in [0, num_experts); all 0
/// without MoE layers).
struct TrainerReady {
  static constexpr std::string_view kType = "trainer.ready";
  static constexpr uint32_t kVersion = 2;  ///< v2: moe_layers, experts_per_token, num_experts
  int64_t policy_version = 0;
  int64_t vocab_size = 0;
  int64_t moe_layers = 0, experts_per_token = 0, num_experts = 0;
  MSGPACK_DEFINE_MAP(policy_version, vocab_size, moe_layers, experts_per_token, num_experts);
};
/// Load a checkpoint written by trainer.save (or by a one-process run) into the policy and
/// optimizer (answered with TrainerReady: the saved version).
struct TrainerLoad {
  static constexpr std::string_view kType = "trainer.load";
  static constexpr uint32_t kVersion = 1;
  std::string dir;
  MSGPACK_DEFINE_MAP(dir);
};
/// One sample inside TrainerTrain (not a message type by itself).
struct TrainerSampleSpec {
  uint64_t id = 0;
  std::vector<int64_t> prompt, completion;
  std::vector<float> behavior_logprobs;  ///< [n] from the rollout
  std::vector<float> ref_logprobs;       ///< [n] or empty (KL off)
  float advantage = 0;
  MSGPACK_DEFINE_MAP(id, prompt, completion, behavior_logprobs, ref_logprobs, advantage);
};
/// One optimizer step on these samples (answered with TrainerStepResult). Tensor i, when
/// present for every sample, is sample i's routed experts [P + n - 1, L, K] I64 (routing replay).
struct TrainerTrain {
  static constexpr std::string_view kType = "trainer.train";
  static constexpr uint32_t kVersion = 1;
  std::vector<TrainerSampleSpec> samples;
  MSGPACK_DEFINE_MAP(samples);
};
struct TrainerStepResult {
  static constexpr std::string_view kType = "trainer.step_result";
  static constexpr uint32_t kVersion = 3;  // 3: metrics.peak_memory_gib
  trainer::StepMetrics metrics;
  int64_t policy_version = 0;  ///< after the step
  MSGPACK_DEFINE_MAP(metrics, policy_version);
};
/// Stream the current policy version to each target actor (weight_sync.bucket/commit, checked
/// by the receiver) before answering TrainerPushed; an error names the target that failed.
struct TrainerPushWeights {
  static constexpr std::string_view kType = "trainer.push_weights";
  static constexpr uint32_t kVersion = 1;
  std::vector<std::string> targets;
  MSGPACK_DEFINE_MAP(targets);
};
struct TrainerPushed {
  static constexpr std::string_view kType = "trainer.pushed";
  static constexpr uint32_t kVersion = 1;
  int64_t policy_version = 0;
  MSGPACK_DEFINE_MAP(policy_version);
};
/// Write a checkpoint (actors/trainer/checkpoint.hpp) into `dir` (answered with TrainerPushed:
/// the saved version). v2: an optional uint8 tensor frame named kInFlightFrame holds the
/// controller's rollouts in flight (CheckpointState::in_flight_rollouts), written with it.
struct TrainerSave {
  static constexpr std::string_view kType = "trainer.save";
  static constexpr uint32_t kVersion = 2;
  static constexpr std::string_view kInFlightFrame = "in_flight_rollouts";
  std::string dir;
  int64_t step = 0;
  std::string prompt_rng;
  MSGPACK_DEFINE_MAP(dir, step, prompt_rng);
};

/// To a trainer rank other than 0 of an expert-parallel trainer (experiments/ranks.hpp): take
/// part in gathering the full experts while rank 0 reads the policy's HF weights (its
/// hf_state_dict is collective over ep; the other ranks drop what they gather on the device).
/// Answered with TrainerPushed.
struct TrainerGatherWeights {
  static constexpr std::string_view kType = "trainer.gather_weights";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;  ///< the version rank 0 reads (checked)
  MSGPACK_DEFINE_MAP(version);
};

/// To a trainer rank other than 0 of an expert-parallel trainer: take part in the expert
/// all-gathers of a collective weight sync while rank 0 sends the policy to the engines
/// (weight_sync::join_expert_gathers). Answered with TrainerPushed.
struct TrainerSyncExperts {
  static constexpr std::string_view kType = "trainer.sync_experts";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;  ///< the version rank 0 sends (checked)
  MSGPACK_DEFINE_MAP(version);
};

/// To a trainer rank other than 0 (placement.mode = "colocated"): generate `requests` on this
/// rank's engine over its own policy (rollout::ColocatedEngine, built by the first of these
/// with `engine`), in lockstep with the other ranks of its ep group. Answered with
/// rollout.result (RolloutResult and its replay frames).
struct TrainerGenerate {
  static constexpr std::string_view kType = "trainer.generate";
  static constexpr uint32_t kVersion = 1;
  int64_t version = 0;  ///< the version rank 0 holds (checked)
  rollout::EngineOptions engine;
  std::vector<RolloutRequestSpec> requests;
  MSGPACK_DEFINE_MAP(version, engine, requests);
};

/// Every type above is spoken by a program that includes this header.
inline const bool kTrainerMessages = declare_message_types<TrainerInit, TrainerReady, TrainerLoad, TrainerTrain, TrainerStepResult, TrainerPushWeights, TrainerPushed, TrainerSave, TrainerGatherWeights, TrainerSyncExperts, TrainerGenerate>();

}  // namespace kiln::messaging
