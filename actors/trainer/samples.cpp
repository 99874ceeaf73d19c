#include "actors/trainer/samples.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace kiln::trainer {

namespace {
// A value for a message: "nan" whatever its sign bit (std::to_string may write "-nan").
std::string number(double x) { return std::isnan(x) ? "nan" : std::to_string(x); }
}  // namespace

Packed pack(const std::vector<Sample>& samples, const std::vector<std::size_t>& idx, bool replay) {
  std::vector<std::vector<int64_t>> docs;
  std::vector<int64_t> positions, owner;
  std::vector<torch::Tensor> experts, selections;
  bool can_replay = replay, can_replay_topk = replay;
  int64_t offset = 0;
  for (std::size_t k = 0; k < idx.size(); ++k) {
    const auto& s = samples[idx[k]];
    std::vector<int64_t> doc = s.prompt;
    doc.insert(doc.end(), s.completion.begin(), s.completion.end());
    const int64_t P = int64_t(s.prompt.size()), n = int64_t(s.completion.size());
    for (int64_t j = 0; j < n; ++j) {  // row P - 1 + j predicts completion[j]
      positions.push_back(offset + P - 1 + j);
      owner.push_back(int64_t(k));
    }
    if (!s.routed_experts.defined() || s.routed_experts.size(0) != P + n - 1) can_replay = false;
    else  // the last token is never fed by the rollout; its routing affects no trained output
      experts.push_back(torch::cat({s.routed_experts, s.routed_experts.narrow(0, P + n - 2, 1)}, 0));
    if (!s.topk_indices.defined() || s.topk_indices.size(0) != P + n - 1) can_replay_topk = false;
    else  // the same for the last token: its selection (that of the row before) reaches no trained output
      selections.push_back(torch::cat({s.topk_indices, s.topk_indices.narrow(0, P + n - 2, 1)}, 0));
    offset += P + n;
    docs.push_back(std::move(doc));
  }
  Packed p;
  p.batch = model::PackedBatch::from_documents(docs);
  p.targets = model::next_token_targets(p.batch.input_ids, p.batch.cu_seqlens);
  p.completion_positions = torch::tensor(positions, torch::kInt64);
  p.completion_sample = std::move(owner);
  if (can_replay && !experts.empty()) p.replay = torch::cat(experts, 0);
  if (can_replay_topk && !selections.empty()) p.replay_topk = torch::cat(selections, 0);
  return p;
}

torch::Tensor per_token(const std::vector<Sample>& samples, const std::vector<std::size_t>& idx,
                        const std::vector<float> Sample::*field) {
  std::vector<float> v;
  for (auto i : idx) v.insert(v.end(), (samples[i].*field).begin(), (samples[i].*field).end());
  return torch::tensor(v, torch::kFloat32);
}

void check_samples(const std::vector<Sample>& samples, const model::CausalLM& policy, bool need_ref,
                   bool routing_replay) {
  const int64_t vocab = policy.vocab_size();
  if (samples.empty()) throw std::invalid_argument("train_step: no samples");
  const bool given_old = !samples.front().old_logprobs.empty();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    auto bad = [i](const std::string& what) {
      throw std::invalid_argument("train_step: sample " + std::to_string(i) + " " + what);
    };
    const std::size_t n = s.completion.size();
    if (s.prompt.empty()) bad("has an empty prompt (its first completion token needs a token before it)");
    if (n == 0) bad("has an empty completion (no token to train on)");
    for (const auto* ids : {&s.prompt, &s.completion})
      for (auto t : *ids)
        if (t < 0 || t >= vocab)
          bad("has token id " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(vocab) + ")");
    auto check = [&](const std::vector<float>& v, const std::string& name, const std::string& why_needed) {
      if (v.size() != n)
        bad("has " + std::to_string(v.size()) + " " + name + " for " + std::to_string(n) + " completion tokens" +
            why_needed);
      for (std::size_t j = 0; j < n; ++j)
        if (!std::isfinite(v[j]))
          bad("has a non-finite value in " + name + " at token " + std::to_string(j) + ": " + number(v[j]));
    };
    check(s.behavior_logprobs, "behaviour log-probs", "");
    if (need_ref) check(s.ref_logprobs, "reference log-probs", " (kl_coef != 0 needs one per token)");
    if (given_old != !s.old_logprobs.empty())
      bad(std::string(given_old ? "has no old_logprobs, sample 0 has" : "has old_logprobs, sample 0 has none") +
          ": old_logprobs must be given for every completion token of every sample, or for none");
    if (given_old) check(s.old_logprobs, "old log-probs", "");
    if (!std::isfinite(s.advantage)) bad("has a non-finite advantage: " + number(s.advantage));
  }
  if (routing_replay) check_routed_experts(samples, policy, "train_step");
}

void check_routed_experts(const std::vector<Sample>& samples, const model::CausalLM& policy, const std::string& what) {
  const int64_t L = policy.num_moe_layers(), K = policy.experts_per_token(), E = policy.num_experts();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    if (!s.routed_experts.defined()) continue;
    const int64_t rows = int64_t(s.prompt.size() + s.completion.size()) - 1;
    if (auto why = routed_experts_fault(s.routed_experts, rows, L, K, E); !why.empty())
      throw std::invalid_argument(what + ": sample " + std::to_string(i) + " " + why);
  }
}

std::string routed_experts_fault(const torch::Tensor& r, int64_t rows, int64_t layers, int64_t per_token,
                                 int64_t experts) {
  if (r.dim() != 3 || r.size(0) != rows || r.size(1) != layers || r.size(2) != per_token)
    return "has routed experts of shape " + c10::str(r.sizes()) + ", not [" + std::to_string(rows) + ", " +
           std::to_string(layers) + ", " + std::to_string(per_token) +
           "] (prompt + completion - 1 rows; the policy's MoE layers and experts per token)";
  if (r.numel() > 0) {
    const auto [lo, hi] = torch::aminmax(r.to(torch::kCPU, torch::kInt64));
    const int64_t least = lo.item<int64_t>(), most = hi.item<int64_t>();
    if (least < 0 || most >= experts)
      return "has routed expert id " + std::to_string(least < 0 ? least : most) + " outside [0, " +
             std::to_string(experts) + ") (the policy's experts)";
  }
  return "";
}

std::string nonfinite_reason(double loss, double grad_norm) {
  if (!std::isfinite(loss)) return "loss is " + number(loss);
  if (!std::isfinite(grad_norm)) return "gradient norm is " + number(grad_norm);
  return "";
}

void check_same_batch(parallel::Group& group, const std::vector<Sample>& samples) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](const void* data, std::size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(data);
    for (std::size_t k = 0; k < bytes; ++k) hash = (hash ^ b[k]) * 1099511628211ull;
  };
  int64_t tokens = 0;
  for (const auto& s : samples) {
    tokens += s.tokens();
    for (const auto* ids : {&s.prompt, &s.completion}) {
      const auto n = ids->size();
      mix(&n, sizeof n);
      mix(ids->data(), n * sizeof(int64_t));
    }
    for (const auto* v : {&s.behavior_logprobs, &s.ref_logprobs, &s.old_logprobs}) {
      const auto n = v->size();
      mix(&n, sizeof n);
      mix(v->data(), n * sizeof(float));
    }
    mix(&s.advantage, sizeof s.advantage);
  }
  const int64_t fields[3] = {int64_t(samples.size()), tokens, int64_t(hash >> 2)};
  auto t = torch::empty({6}, torch::kInt64);
  for (int k = 0; k < 3; ++k) {
    t[k] = fields[k];
    t[3 + k] = -fields[k];
  }
  t = t.to(group.device());
  group.all_reduce(t, parallel::ReduceOp::max);
  t = t.to(torch::kCPU);
  const char* names[3] = {"sample counts", "token counts", "content hashes"};
  for (int k = 0; k < 3; ++k) {
    const int64_t hi = t[k].item<int64_t>(), lo = -t[3 + k].item<int64_t>();
    if (hi != lo)
      throw std::invalid_argument("train_step: the ranks of data-parallel group '" + group.name() +
                                  "' were given different batches: their " + names[k] + " range from " +
                                  std::to_string(lo) + " to " + std::to_string(hi) +
                                  " (every rank must be given the whole step's samples)");
  }
}

std::vector<std::vector<std::size_t>> plan_micro_batches(const std::vector<Sample>& samples, int64_t max_tokens) {
  std::vector<std::size_t> all(samples.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  return plan_micro_batches(samples, all, max_tokens);
}

std::vector<std::vector<std::size_t>> plan_micro_batches(const std::vector<Sample>& samples,
                                                         const std::vector<std::size_t>& indices, int64_t max_tokens) {
  std::vector<std::vector<std::size_t>> out;
  int64_t in_batch = 0;
  for (auto i : indices) {
    const int64_t t = samples[i].tokens();
    if (out.empty() || (in_batch + t > max_tokens && !out.back().empty())) {
      out.emplace_back();
      in_batch = 0;
    }
    out.back().push_back(i);
    in_batch += t;
  }
  return out;
}

std::vector<std::vector<std::size_t>> split_samples(const std::vector<Sample>& samples, int ranks) {
  if (ranks < 1) throw std::invalid_argument("split_samples: ranks must be >= 1, got " + std::to_string(ranks));
  std::vector<std::size_t> order(samples.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return samples[a].tokens() > samples[b].tokens(); });
  std::vector<std::vector<std::size_t>> out(static_cast<std::size_t>(ranks));
  std::vector<int64_t> load(static_cast<std::size_t>(ranks), 0);
  for (auto i : order) {
    const auto r = std::size_t(std::min_element(load.begin(), load.end()) - load.begin());  // first of the least loaded
    out[r].push_back(i);
    load[r] += samples[i].tokens();
  }
  for (auto& share : out) std::sort(share.begin(), share.end());
  return out;
}

}  // namespace kiln::trainer
