#include "actors/reference/ref_messages.hpp"

#include <stdexcept>

#include "messaging/replay_frames.hpp"

namespace kiln::reference {

using namespace kiln::messaging;

Envelope logprobs_request(const std::vector<rollout::Completion>& completions, bool routing_replay,
                          const std::string& sender, const std::string& receiver) {
  RefLogprobs q;
  std::vector<torch::Tensor> experts, selections;
  for (const auto& s : completions) {
    q.samples.push_back({s.id, s.prompt, s.tokens});
    experts.push_back(s.routed_experts);
    selections.push_back(s.topk_indices);
  }
  auto env = make_envelope(q, Kind::request, sender, receiver);
  if (routing_replay) env.tensors = replay_frames(experts, selections);
  return env;
}

Expected<std::vector<trainer::Sample>> requested_samples(const Envelope& request, bool* replay) {
  auto q = payload_as<RefLogprobs>(request);
  if (!q) return q.error();
  *replay = !request.tensors.empty();
  std::vector<int64_t> rows;
  for (const auto& spec : q->samples) rows.push_back(int64_t(spec.prompt.size() + spec.completion.size()) - 1);
  ReplayTensors replayed;
  try {
    replayed = read_replay_frames(request.tensors, rows, "ref.logprobs");
  } catch (const std::invalid_argument& e) {
    return make_error(ErrorCode::bad_message, e.what());
  }
  std::vector<trainer::Sample> samples(q->samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& spec = q->samples[i];
    if (spec.prompt.empty() || spec.completion.empty())
      return make_error(ErrorCode::bad_message,
                        "ref.logprobs: sample " + std::to_string(spec.id) + " has an empty prompt or completion");
    samples[i].prompt = spec.prompt;
    samples[i].completion = spec.completion;
    if (*replay) samples[i].routed_experts = std::move(replayed.routed_experts[i]);
    if (!replayed.topk_indices.empty()) samples[i].topk_indices = std::move(replayed.topk_indices[i]);
  }
  return samples;
}

std::vector<std::vector<float>> read_logprobs(const Envelope& reply, const std::vector<rollout::Completion>& asked,
                                              const std::string& who) {
  auto res = payload_as<RefLogprobsResult>(reply);
  if (!res) throw std::runtime_error(who + ": " + res.error().what());
  if (res->logprobs.size() != asked.size())
    throw std::runtime_error(who + " answered " + std::to_string(res->logprobs.size()) + " samples for " +
                             std::to_string(asked.size()));
  for (std::size_t i = 0; i < asked.size(); ++i)
    if (res->logprobs[i].size() != asked[i].tokens.size())
      throw std::runtime_error(who + " answered " + std::to_string(res->logprobs[i].size()) +
                               " log-probs for a completion of " + std::to_string(asked[i].tokens.size()) + " tokens");
  return std::move(res->logprobs);
}

}  // namespace kiln::reference
