#pragma once
// rollout.generate's requests and rollout.result's completions (actors/rollout/messages.hpp,
// docs/wire-format.md) to and from the engine's types, written once for every actor that
// generates for another process: a rollout node (rollout_service.hpp), a trainer rank running
// its colocated engine (trainer.generate), and the controller reading their answers.
#include <map>
#include <string>
#include <vector>

#include "actors/rollout/backend.hpp"
#include "actors/rollout/messages.hpp"
#include "messaging/envelope.hpp"

namespace kiln::rollout {

messaging::RolloutRequestSpec to_spec(const GenerationRequest& q);
GenerationRequest from_spec(const messaging::RolloutRequestSpec& r);

/// The reply to `request` carrying `completions` (RolloutResult in their order, each one's
/// routed experts and sparse-attention selections as tensor frames, messaging/replay_frames.hpp).
messaging::Envelope result_reply(const messaging::Envelope& request, const std::vector<Completion>& completions);

/// The completions of a RolloutResult `reply` to requests `asked` (their ids and prompts; the
/// prompts are not sent back). Throws std::runtime_error starting with `who` for a payload that
/// does not decode, a count other than asked.size(), an id not asked for, or replay frames that
/// do not fit the completions.
std::vector<Completion> read_result(const messaging::Envelope& reply, const std::vector<GenerationRequest>& asked,
                                    const std::string& who);

}  // namespace kiln::rollout
