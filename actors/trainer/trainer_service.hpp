#pragma once
// The trainer actor's logic (plain class): owns the policy, the optimizer and the weight-sync
// sender of a run whose trainer is placed in its own process (placement.trainer = "process";
// hosted by `kiln node --actor trainer/N`). Messages (actors/trainer/messages.hpp, docs/wire-format.md):
//   trainer.init          build the policy (seeded as a one-process run) and the trainer
//   trainer.load          load a checkpoint (actors/trainer/checkpoint.hpp)
//   trainer.push_weights  stream the current version to rollout/ref actors (weight_sync.*)
//   trainer.train         one optimizer step on the given samples; metrics back
//   trainer.save          write a checkpoint
//   trainer.generate      (a rank of placement.mode "colocated") its share of a rollout, on an
//                         engine over its own policy, in lockstep with its ep group
//   ref.logprobs          (a rank of placement.reference "colocated") its share of the
//                         reference log-probs, from its frozen copy of the initial policy
// Requests are handled one at a time (one detached actor), so a push never sees a
// half-updated policy. A data-parallel rank other than 0 (experiments/ranks.hpp) runs the
// same service over its dp group: rank 0 sends it the requests it runs itself.
#include <memory>
#include <string>

#include "messaging/envelope.hpp"
#include "actors/rollout/lockstep.hpp"
#include "actors/trainer/messages.hpp"
#include "actors/trainer/trainer.hpp"
#include "actors/weight_sync/collective.hpp"

namespace kiln::messaging {
class Gateway;
}

namespace kiln::trainer {

class TrainerService {
 public:
  /// `gateway`: where trainer.push_weights sends from; `name`: this actor's logical name.
  TrainerService(messaging::Gateway& gateway, const std::string& name);
  /// A trainer rank of kiln run (experiments/ranks.hpp): trainer.init builds make_trainer(policy,
  /// config, ranks), so init, load, train, save and trainer.gather_weights are collective over
  /// the ranks (held by reference).
  TrainerService(messaging::Gateway& gateway, const std::string& name, parallel::ProcessGroups* ranks);
  ~TrainerService();
  /// Errors name what was wrong: a request before trainer.init, a bad setting, a sample whose
  /// sizes do not fit (log-probs vs tokens, routed-experts tensors vs samples), token ids out
  /// of the vocabulary, an unreadable checkpoint, a push target that is unknown or fails its
  /// check. A failed trainer.train leaves the policy and optimizer as they were.
  /// A request whose collectives failed (a peer rank lost) is answered with
  /// ErrorCode::collective_failed: this rank can no longer take part (collectives_failed()).
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& request);
  /// True once a collective of this rank's groups failed: the rank should answer and exit, so
  /// that the ranks waiting on it in their own collectives see its connections close.
  bool collectives_failed() const;

 private:
  messaging::ErrorCode failure_code() const;
  struct State;
  std::unique_ptr<State> s_;
};

/// The trainer.train request for `samples` (what handle() decodes): routed experts and
/// sparse-attention selections as tensor frames (messaging/replay_frames.hpp) when every sample
/// has them.
/// The policy's routed-expert slices of an expert-parallel `trainer` by their kiln names, for
/// the collective weight sync (every ep rank gathers them in its packing order); none (no ep
/// group) without expert parallel.
weight_sync::ExpertSlices sync_expert_slices(model::CausalLM& policy, const Trainer& trainer);

/// The engine of a trainer rank over its own policy (placement.mode = "colocated",
/// rollout::ColocatedEngine). Throws std::invalid_argument for a fully sharded trainer (its
/// layers are shards between steps) and what rollout::Engine throws for `options`.
std::unique_ptr<rollout::ColocatedEngine> make_colocated_engine(std::shared_ptr<model::CausalLM> policy,
                                                               const Trainer& trainer,
                                                               const rollout::EngineOptions& options);

messaging::Envelope train_request(const std::vector<Sample>& samples, const std::string& sender,
                                  const std::string& receiver);

/// Registers actor kind "trainer" with kiln node (call once at start-up, before hosting actors).
void register_trainer_actor_kind();

}  // namespace kiln::trainer
