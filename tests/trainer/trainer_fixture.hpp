#pragma once
// The trainer suites' fixture: the seeded debug GLM model, rollout samples drawn from it, and a
// copy of everything an optimizer step may change, to show that a step changed nothing.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "actors/rollout/engine.hpp"
#include "actors/trainer/trainer.hpp"
#include "model/glm4_moe_lite/model.hpp"

namespace kiln::test {

inline std::shared_ptr<model::glm4_moe_lite::Glm4MoeLiteModel> debug_model(uint64_t seed) {
  torch::manual_seed(int64_t(seed));
  return std::make_shared<model::glm4_moe_lite::Glm4MoeLiteModel>(model::glm4_moe_lite::flavors::debug());
}

/// A GLM-4.7-Flash-shaped model smaller than debug() (about 6k parameters: one dense layer, one
/// MoE layer of 4 experts top-2 + 1 shared), for checked-in checkpoints that must stay small.
inline model::glm4_moe_lite::Glm4MoeLiteConfig tiny_config() {
  auto c = model::glm4_moe_lite::flavors::debug();
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 16;
  c.num_hidden_layers = 2;
  c.moe_layers = {false, true};
  c.attention = model::glm4_moe_lite::AttentionConfig{2, 8, 8, 8, 4, 8, 10000.0, true};
  c.moe = model::glm4_moe_lite::MoEConfig{4, 2, 1, 1, 8, 1, true, 1.8};
  c.validate();
  return c;
}

/// `count` samples from a std::mt19937_64 seeded with `seed` (the same on every build and
/// machine): prompts of 2-6 and completions of 1-8 token ids in [2, vocab), behaviour
/// log-probs in [-4, -2], advantages in [-1.5, 1.5]. No routed experts (no replay).
inline std::vector<trainer::Sample> random_samples(uint64_t seed, int count, int64_t vocab) {
  std::mt19937_64 rng(seed);
  // The draws by hand (not std:: distributions, whose algorithms are the library's choice).
  auto integer = [&](int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); };
  auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * double(rng() >> 11) * 0x1.0p-53; };
  std::vector<trainer::Sample> out(static_cast<std::size_t>(count));
  for (auto& s : out) {
    for (int64_t k = integer(2, 6); k > 0; --k) s.prompt.push_back(integer(2, vocab - 1));
    for (int64_t k = integer(1, 8); k > 0; --k) {
      s.completion.push_back(integer(2, vocab - 1));
      s.behavior_logprobs.push_back(float(uniform(-4.0, -2.0)));
    }
    s.advantage = float(uniform(-1.5, 1.5));
  }
  return out;
}

/// The in-process engine's completions of `requests` as samples, with advantage `odd` on odd
/// request ids and `even` on even ones.
inline std::vector<trainer::Sample> generate_samples(std::shared_ptr<model::CausalLM> m,
                                                     const std::vector<rollout::GenerationRequest>& requests,
                                                     float odd, float even,
                                                     const rollout::EngineOptions& options = {}) {
  rollout::Engine engine(m, options);
  std::vector<trainer::Sample> out;
  for (auto& c : engine.generate(requests)) {
    trainer::Sample s;
    s.prompt = c.prompt;
    s.completion = c.tokens;
    s.behavior_logprobs = c.logprobs;
    s.routed_experts = c.routed_experts;
    s.advantage = c.id % 2 ? odd : even;
    out.push_back(std::move(s));
  }
  return out;
}

/// `count` rollouts (prompts {3+i, 4+i, 5, 6+2i}, 3 + i % 4 new tokens, seed 100 + i), with
/// advantage +1 on odd ids and -0.5 on even ones.
inline std::vector<trainer::Sample> rollout_samples(std::shared_ptr<model::CausalLM> m, int count,
                                                    double temperature = 1.0,
                                                    const rollout::EngineOptions& options = {}) {
  std::vector<rollout::GenerationRequest> reqs;
  for (int i = 0; i < count; ++i) {
    rollout::GenerationRequest r;
    r.id = uint64_t(i);
    r.prompt = {3 + i, 4 + i, 5, 6 + 2 * i};
    r.sampling.max_new_tokens = 3 + i % 4;
    r.sampling.seed = uint64_t(100 + i);
    r.sampling.temperature = temperature;
    reqs.push_back(r);
  }
  return generate_samples(m, reqs, 1.0f, -0.5f, options);
}

/// |trainer - rollout| per-token log-prob of `samples`: mean, max, and the number of tokens.
struct LogprobGap {
  double mean = 0, max = 0;
  int64_t n = 0;
};
/// The gap of per-sample log-probs `lp` (completion_logprobs' shape) to the samples' behaviour
/// log-probs.
inline LogprobGap logprob_gap(const std::vector<std::vector<float>>& lp, const std::vector<trainer::Sample>& samples) {
  LogprobGap g;
  double sum = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    if (lp[i].size() != samples[i].behavior_logprobs.size())
      throw std::logic_error("logprob_gap: sample " + std::to_string(i) + " has " + std::to_string(lp[i].size()) +
                             " log-probs but " + std::to_string(samples[i].behavior_logprobs.size()) +
                             " behaviour log-probs");
    for (std::size_t j = 0; j < lp[i].size(); ++j) {
      const double d = std::abs(double(lp[i][j]) - double(samples[i].behavior_logprobs[j]));
      sum += d;
      g.max = std::max(g.max, d);
      ++g.n;
    }
  }
  g.mean = sum / double(std::max<int64_t>(1, g.n));
  return g;
}
/// The gap of `samples` under `m`'s no-grad packed forward with log-prob settings `c`.
inline LogprobGap train_rollout_gap(model::CausalLM& m, const std::vector<trainer::Sample>& samples,
                                    const trainer::LogprobConfig& c) {
  return logprob_gap(trainer::completion_logprobs(m, samples, c), samples);
}
/// The same in packs of 4096 tokens, routing replayed.
inline LogprobGap train_rollout_gap(model::CausalLM& m, const std::vector<trainer::Sample>& samples) {
  return logprob_gap(trainer::completion_logprobs(m, samples, 4096, /*routing_replay=*/true), samples);
}

/// Everything a Trainer's step may change, copied: the policy's parameters, the master
/// weights, AdamW's moments and step count per master, the learning rate, the version.
struct TrainerSnapshot {
  std::vector<torch::Tensor> params, masters, exp_avg, exp_avg_sq;
  std::vector<int64_t> steps;  ///< -1: AdamW holds no state for that master yet
  double lr = 0;
  int64_t version = 0;
};

inline TrainerSnapshot snapshot(trainer::Trainer& t) {
  TrainerSnapshot s;
  for (const auto& p : t.policy().parameters()) s.params.push_back(p.detach().clone());
  const auto& state = t.optimizer().state();
  for (const auto& p : t.master_parameters()) {
    s.masters.push_back(p.detach().clone());
    auto it = state.find(p.unsafeGetTensorImpl());
    if (it == state.end()) {
      s.exp_avg.emplace_back();
      s.exp_avg_sq.emplace_back();
      s.steps.push_back(-1);
      continue;
    }
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    s.exp_avg.push_back(adam.exp_avg().clone());
    s.exp_avg_sq.push_back(adam.exp_avg_sq().clone());
    s.steps.push_back(adam.step());
  }
  s.lr = t.optimizer().param_groups().front().options().get_lr();
  s.version = t.version();
  return s;
}

/// What differs between two snapshots, by name (empty when equal bit for bit).
inline std::vector<std::string> differences(const TrainerSnapshot& a, const TrainerSnapshot& b) {
  std::vector<std::string> out;
  auto same = [](const torch::Tensor& x, const torch::Tensor& y) {
    if (!x.defined() || !y.defined()) return x.defined() == y.defined();
    // Bit for bit: as integers of the same width (NaN == NaN, -0 != +0).
    auto bits = [](const torch::Tensor& t) {
      const auto width = t.element_size();
      return t.contiguous().view(width == 2 ? torch::kInt16 : width == 4 ? torch::kInt32 : torch::kInt64);
    };
    return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && torch::equal(bits(x), bits(y));
  };
  auto tensors = [&](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& y, const char* what) {
    if (x.size() != y.size()) return out.push_back(std::string(what) + ": count");
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!same(x[i], y[i])) out.push_back(std::string(what) + " " + std::to_string(i));
  };
  tensors(a.params, b.params, "parameter");
  tensors(a.masters, b.masters, "master");
  tensors(a.exp_avg, b.exp_avg, "exp_avg");
  tensors(a.exp_avg_sq, b.exp_avg_sq, "exp_avg_sq");
  if (a.steps != b.steps) out.push_back("AdamW step count");
  if (a.lr != b.lr) out.push_back("lr");
  if (a.version != b.version) out.push_back("version");
  return out;
}

}  // namespace kiln::test
