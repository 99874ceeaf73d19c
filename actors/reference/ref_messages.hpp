#pragma once
// ref.logprobs and its answer (actors/reference/messages.hpp, docs/wire-format.md) to and from
// the trainer's types, written once for every actor that computes reference log-probs for
// another process: a reference node (ref_service.hpp), a trainer rank holding the colocated
// reference (placement.reference = "colocated"), and the controller reading their answers.
#include <string>
#include <vector>

#include "actors/reference/messages.hpp"
#include "actors/rollout/backend.hpp"
#include "actors/trainer/trainer.hpp"
#include "messaging/envelope.hpp"

namespace kiln::reference {

/// The ref.logprobs request for `completions` (prompt and tokens; with `routing_replay`, their
/// routed experts and selections as tensor frames, messaging/replay_frames.hpp).
messaging::Envelope logprobs_request(const std::vector<rollout::Completion>& completions, bool routing_replay,
                                     const std::string& sender, const std::string& receiver);

/// What a ref.logprobs `request` asks for: the samples (prompt, completion, replayed routing
/// when the request carries frames; *replay says whether it did). Errors (bad_message) name a
/// payload that does not decode, frames that do not fit, an empty prompt or completion.
messaging::Expected<std::vector<trainer::Sample>> requested_samples(const messaging::Envelope& request, bool* replay);

/// The log-probs of a RefLogprobsResult `reply` to `asked`: one per completion token. Throws
/// std::runtime_error starting with `who` for a payload that does not decode or counts that do
/// not fit.
std::vector<std::vector<float>> read_logprobs(const messaging::Envelope& reply,
                                              const std::vector<rollout::Completion>& asked, const std::string& who);

}  // namespace kiln::reference
