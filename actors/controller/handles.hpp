#pragma once
// The controller's view of the actors it drives: one interface each for the trainer, the
// rollout engines and the reference policy. Each has a local implementation (in this process,
// local_handles.hpp) and a remote one (actors in `kiln node` child processes, driven over
// ZeroMQ: remote_handles.hpp); placement.hpp picks them once, at start. The loop
// (loop.hpp) sees only these interfaces. Legend: P prompt tokens, n completion tokens.
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "actors/rollout/backend.hpp"
#include "actors/rollout/engine_options.hpp"
#include "actors/trainer/checkpoint.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/collective.hpp"
#include "messaging/tensor.hpp"

namespace kiln::controller {

/// A policy version on its way to the engines: its HF-named tensors (owned copies when the
/// trainer goes on changing its parameters meanwhile), or none when the trainer streams them
/// itself (a trainer node sends its newest version, never older than `version`).
struct PolicyWeights {
  int64_t version = 0;
  std::vector<messaging::Tensor> tensors;
};

/// The policy and everything trained with it went down with its process: only checkpoints
/// already written remain.
struct PolicyLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The policy's routing: routing replay's routed experts are [T, layers, per_token] ids in
/// [0, experts) (T: prompt + completion - 1 rows); all 0 for a policy without MoE layers.
struct RoutingShape {
  int64_t layers = 0, per_token = 0, experts = 0;
};

/// The policy being trained: its optimizer steps, its weights for the engines, checkpoints.
class TrainerHandle {
 public:
  virtual ~TrainerHandle() = default;
  virtual int64_t version() const = 0;     ///< optimizer steps taken
  virtual int64_t vocab_size() const = 0;
  virtual RoutingShape routing_shape() const = 0;
  /// One optimizer step on GRPO samples (prompt, completion, advantage, behaviour and
  /// reference log-probs, routed experts). Throws PolicyLost, or std::runtime_error for a
  /// refused batch (the policy unchanged).
  virtual trainer::StepMetrics train(std::vector<trainer::Sample> samples) = 0;
  /// The current version for the engines; `copy`: owned copies (the caller trains on).
  virtual PolicyWeights weights(bool copy) = 0;
  /// Streams `w` to each actor of `targets` (weight_sync.bucket/commit, checked by the
  /// receiver before it applies them). Throws std::runtime_error naming the target that failed.
  /// Safe to call from another thread than train().
  virtual void send(const PolicyWeights& w, const std::vector<std::string>& targets) = 0;
  /// Collective weight sync (weight_sync.transport = "collective"): the device of the policy
  /// this process holds, which the broadcast group runs on. Throws std::logic_error for a
  /// trainer whose policy lives in another process.
  virtual torch::Device policy_device() const {
    throw std::logic_error("collective weight sync needs the trainer in the controller's process");
  }
  /// Broadcasts the current version over `sender`'s group to its engines
  /// (weight_sync/collective.hpp). Throws std::runtime_error naming an engine that failed.
  virtual void send_collective(weight_sync::CollectiveSender&) {
    throw std::logic_error("collective weight sync needs the trainer in the controller's process");
  }
  /// Writes a checkpoint of the policy, the optimizer and `state` (step, prompt RNG; the
  /// policy version is the trainer's own) into `dir` (actors/trainer/checkpoint.hpp).
  virtual void save(const std::filesystem::path& dir, const trainer::CheckpointState& state) = 0;
  /// Loads a checkpoint into the policy and optimizer; returns its loop state. Throws
  /// std::invalid_argument naming what is missing or does not fit.
  virtual trainer::CheckpointState load(const std::filesystem::path& dir) = 0;
  /// placement.mode = "colocated": generates `requests` on engines over the trainer's own
  /// policy (rollout::ColocatedEngine; `engine` builds them at the first call), one per trainer
  /// rank, whole prompt groups of `group_size` to each, the ranks of an ep group in lockstep.
  /// Completions sorted by id, at version(). Throws std::logic_error for a trainer in another
  /// process, std::invalid_argument for a request or engine setting refused, PolicyLost for a
  /// rank lost.
  virtual std::vector<rollout::Completion> generate_colocated(std::vector<rollout::GenerationRequest> /*requests*/,
                                                              const rollout::EngineOptions& /*engine*/,
                                                              int64_t /*group_size*/,
                                                              const std::function<void()>& /*between_steps*/) {
    throw std::logic_error("colocated engines need the trainer in the controller's process (placement.trainer = "
                           "\"controller\")");
  }
  /// placement.reference = "colocated": the frozen reference's per-token log-probs of
  /// `completions` (result[i]: completions[i].tokens.size() values), computed by the trainer's
  /// ranks, each over its share (trainer::FrozenReference). Throws std::logic_error for a
  /// trainer holding no reference, PolicyLost for a rank lost.
  virtual std::vector<std::vector<float>> reference_logprobs(const std::vector<rollout::Completion>&) {
    throw std::logic_error("this trainer holds no reference (placement.reference = \"colocated\" with "
                           "placement.trainer = \"controller\")");
  }
};

/// Contiguous shares [begin, end) of `requests` requests for `engines` engines, whole prompt
/// groups of `group_size` each (share i: groups G*i/N .. G*(i+1)/N).
inline std::vector<std::pair<std::size_t, std::size_t>> prompt_group_shares(std::size_t requests, int64_t group_size,
                                                                            std::size_t engines) {
  const std::size_t G = requests / std::size_t(group_size), N = engines, g = std::size_t(group_size);
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t i = 0; i < N; ++i) out.emplace_back(G * i / N * g, G * (i + 1) / N * g);
  return out;
}

/// The rollout engines: generate completions, take new weights.
class RolloutEngines {
 public:
  virtual ~RolloutEngines() = default;
  /// Generates `requests` to completion (whole prompt groups per engine when there are
  /// several); `between_steps` runs between decode steps of an engine in this process.
  /// Completions sorted by id. Throws std::runtime_error naming a lost or misbehaving engine.
  virtual std::vector<rollout::Completion> generate(std::vector<rollout::GenerationRequest> requests,
                                                    const std::function<void()>& between_steps) = 0;
  /// Loads `w` into every engine, sent by `trainer` and checked by each engine first (between
  /// decode steps: sequences in flight continue with the new weights). Throws
  /// std::runtime_error naming the engine that failed.
  virtual void load(const PolicyWeights& w, TrainerHandle& trainer) = 0;
  /// Whether load() reads PolicyWeights::tensors; false when the trainer sends the engines its
  /// own tensors (collective weight sync), so the HF-named copy need not be made.
  virtual bool needs_tensors() const { return true; }
};

/// The frozen reference policy (the run's initial weights) for the KL term and metric.
class ReferencePolicy {
 public:
  virtual ~ReferencePolicy() = default;
  /// result[i]: per-token log-probs [n] of completions[i] (routing replayed when configured).
  /// Throws std::runtime_error naming a lost reference node.
  virtual std::vector<std::vector<float>> logprobs(const std::vector<rollout::Completion>& completions) = 0;
};

}  // namespace kiln::controller
