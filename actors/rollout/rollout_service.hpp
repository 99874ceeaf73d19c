#pragma once
// The rollout actor's logic (plain class): builds an engine on `rollout.init`, answers
// `rollout.generate` with the completions (routed experts as tensor frames), and loads new
// weights from `weight_sync.*` between generations. Hosted by `kiln node --actor rollout/N`.
#include <memory>
#include <string>

#include "messaging/envelope.hpp"

namespace kiln::rollout {

class RolloutService {
 public:
  RolloutService();
  ~RolloutService();
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& request);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// Registers actor kind "rollout" with kiln node (call once at start-up, before hosting actors).
void register_rollout_actor_kind();

}  // namespace kiln::rollout
