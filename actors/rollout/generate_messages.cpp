#include "actors/rollout/generate_messages.hpp"

#include <stdexcept>

#include "messaging/replay_frames.hpp"

namespace kiln::rollout {

using namespace kiln::messaging;

RolloutRequestSpec to_spec(const GenerationRequest& q) {
  const auto& sp = q.sampling;
  return {q.id, q.prompt, sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, sp.seed, sp.stop_token_ids};
}

GenerationRequest from_spec(const RolloutRequestSpec& r) {
  GenerationRequest q;
  q.id = r.id;
  q.prompt = r.prompt;
  q.sampling.temperature = r.temperature;
  q.sampling.top_p = r.top_p;
  q.sampling.top_k = r.top_k;
  q.sampling.max_new_tokens = r.max_new_tokens;
  q.sampling.seed = r.seed;
  q.sampling.stop_token_ids = r.stop_token_ids;
  return q;
}

Envelope result_reply(const Envelope& request, const std::vector<Completion>& completions) {
  RolloutResult result;
  std::vector<torch::Tensor> experts, selections;
  for (const auto& c : completions) {
    result.completions.push_back({c.id, c.tokens, c.policy_versions, c.logprobs, c.entropies,
                                  to_string(c.finish_reason), c.time_to_first_token_s});
    experts.push_back(c.routed_experts);
    selections.push_back(c.topk_indices);
  }
  auto reply = make_envelope(result, Kind::reply, request.receiver, request.sender);
  reply.tensors = replay_frames(experts, selections);
  return reply;
}

std::vector<Completion> read_result(const Envelope& reply, const std::vector<GenerationRequest>& asked,
                                    const std::string& who) {
  auto res = payload_as<RolloutResult>(reply);
  if (!res) throw std::runtime_error(who + ": " + res.error().what());
  if (res->completions.size() != asked.size())
    throw std::runtime_error(who + " answered " + std::to_string(res->completions.size()) + " completions for " +
                             std::to_string(asked.size()) + " requests");
  std::map<uint64_t, const std::vector<int64_t>*> prompts;  // by request id
  for (const auto& q : asked) prompts[q.id] = &q.prompt;
  auto prompt_of = [&](uint64_t id) -> const std::vector<int64_t>& {
    auto it = prompts.find(id);
    if (it == prompts.end()) throw std::runtime_error(who + " answered an unknown request id " + std::to_string(id));
    return *it->second;
  };
  std::vector<int64_t> rows;
  for (const auto& sp : res->completions) rows.push_back(int64_t(prompt_of(sp.id).size() + sp.tokens.size()) - 1);
  ReplayTensors replayed;
  try {
    replayed = read_replay_frames(reply.tensors, rows, who);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  }
  std::vector<Completion> out;
  for (std::size_t k = 0; k < res->completions.size(); ++k) {
    auto& sp = res->completions[k];
    Completion c;
    c.id = sp.id;
    c.prompt = prompt_of(sp.id);
    c.tokens = std::move(sp.tokens);
    c.logprobs = std::move(sp.logprobs);
    c.entropies = std::move(sp.entropies);
    c.policy_versions = std::move(sp.policy_versions);
    c.finish_reason = sp.finish_reason == "stop" ? FinishReason::stop : FinishReason::length;
    c.time_to_first_token_s = sp.time_to_first_token_s;
    if (!replayed.routed_experts.empty()) c.routed_experts = std::move(replayed.routed_experts[k]);
    if (!replayed.topk_indices.empty()) c.topk_indices = std::move(replayed.topk_indices[k]);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace kiln::rollout
