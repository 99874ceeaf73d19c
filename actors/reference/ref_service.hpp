#pragma once
// The reference-logprob actor's logic (plain class): holds a frozen copy of the run's initial
// policy and answers per-token log-probs of completions for the KL term and metric. Builds the
// model on `ref.init`, takes its weights as `weight_sync.bucket`/`commit` (checked before
// they are applied), then answers `ref.logprobs`. Hosted by `kiln node --actor ref/N`.
#include <memory>

#include "messaging/envelope.hpp"

namespace kiln::reference {

class RefService {
 public:
  RefService();
  ~RefService();
  /// Errors name what was wrong: requests before ref.init or before the weights, a routed
  /// experts tensor that does not fit its sample, a malformed payload.
  messaging::Expected<messaging::Envelope> handle(const messaging::Envelope& request);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// Registers actor kind "ref" with kiln node (call once at start-up, before hosting actors).
void register_ref_actor_kind();

}  // namespace kiln::reference
